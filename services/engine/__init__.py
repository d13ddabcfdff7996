"""Torch Llama engine over the paged KV pool, model loaders and the reference engine.

Import the modules themselves; this package imports nothing, so that the torch-free ones
(`config`, `tokenizer`, `checkpoint`) load without torch, as the gateway needs:

- `config` (ModelConfig), `tokenizer` (Tokenizer, ByteTokenizer, HFTokenizer),
  `checkpoint` (model specs, smollm2 fetch, geometry and tokenizer from metadata): no torch;
- `model` (Llama math, LoadedModel), `tiny`, `gguf_loader`, `safetensors_loader`,
  `models` (load_model), `runner` (Engine, make_pool), `reference` (ReferenceEngine),
  `sampling` (Sampler): torch.
"""
