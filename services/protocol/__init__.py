"""The contract every role agrees on: wire messages and subjects (`messages`), the request
lifecycle (`lifecycle`), error types (`errors`), admission tickets and grants (`tickets`)
and the capacity rules admission, prefill and decode share (`capacity`).

Nothing here runs a service; nothing here loads torch.
"""
