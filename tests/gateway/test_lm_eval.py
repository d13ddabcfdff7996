"""lm-evaluation-harness's `local-completions` model against the mesh (SmolLM2): a small
task built here (its data and YAML written in the test, nothing downloaded), run by the
harness itself with batched prompts. Its multiple-choice part is scored with echoed prompt
logprobs (lm-eval's loglikelihood request), whose every value must be the reference
engine's; its generation part with stop strings."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.services.engine.oracle import reference
from tests.support.meshproc import Mesh, run_mesh

pytestmark = [pytest.mark.mesh, pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("PDMESH_LONG_TESTS") != "1",
    reason="SmolLM2 through the mesh, evaluated by lm-eval: make test-long")]

CAPITALS = [("France", "Paris", ["Paris", "Berlin", "Madrid"]),
            ("Germany", "Berlin", ["Rome", "Berlin", "Oslo"]),
            ("Italy", "Rome", ["Rome", "Vienna", "Lisbon"]),
            ("Spain", "Madrid", ["Athens", "Dublin", "Madrid"]),
            ("Japan", "Tokyo", ["Tokyo", "Seoul", "Beijing"]),
            ("Egypt", "Cairo", ["Lagos", "Cairo", "Nairobi"])]


@pytest.fixture(scope="module")
def smollm2_mesh() -> Iterator[Mesh]:
    with run_mesh("--model", "smollm2", "--kv-tokens", "8192", ready_timeout=300) as mesh:
        yield mesh


def _task_dir(root: Path) -> Path:
    data = root / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": ch.index(a)})
                            + "\n" for c, a, ch in CAPITALS))
    gen = root / "arith.jsonl"
    gen.write_text("".join(json.dumps({"q": f"{a} + {b}", "a": str(a + b)}) + "\n"
                           for a, b in ((1, 1), (2, 3), (10, 5), (7, 2))))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "pdmesh_capitals.yaml").write_text(f"""\
task: pdmesh_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (tasks / "pdmesh_arith.yaml").write_text(f"""\
task: pdmesh_arith
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "Q: What is {{{{q}}}}?\\nA:"
doc_to_target: "{{{{a}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""")
    return tasks


def test_lm_eval_local_completions_runs_a_local_task(smollm2_mesh: Mesh, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", "sk-dev-alice")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = reference("smollm2")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={smollm2_mesh.base_url}/completions,model=smollm2,"
                    # the mesh's own tokenizer, through /tokenizer_info and /tokenize
                    "tokenizer_backend=remote,auth_token=sk-dev-alice,batch_size=4,"
                    "num_concurrent=1,max_retries=1,max_length=2048"),
        tasks=["pdmesh_capitals", "pdmesh_arith"],
        task_manager=TaskManager(include_path=str(_task_dir(tmp_path))),
        log_samples=True, apply_chat_template=False)
    capitals = results["results"]["pdmesh_capitals"]
    arith = results["results"]["pdmesh_arith"]
    print("lm-eval:", json.dumps({"capitals_acc": capitals["acc,none"],
                                  "arith_exact_match": arith["exact_match,none"]}))
    assert 0.0 <= capitals["acc,none"] <= 1.0 and 0.0 <= arith["exact_match,none"] <= 1.0
    # Every loglikelihood the harness got is the reference engine's for the same tokens.
    samples = results["samples"]["pdmesh_capitals"]
    assert len(samples) == len(CAPITALS)
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"], sample["resps"], strict=True):
            context, continuation = args
            ctx = ref.tokenizer.encode(context)
            whole = ref.tokenizer.encode(context + continuation)
            assert whole[:len(ctx)] == ctx, "context tokens are a prefix here"
            expected = sum(lp for lp, _ in ref.prompt_logprobs(whole, 1)[len(ctx) - 1:])
            assert resp[0][0] == pytest.approx(expected, abs=1e-3), (context, continuation)
            checked += 1
    assert checked == sum(len(ch) for _, _, ch in CAPITALS)
    gens = results["samples"]["pdmesh_arith"]
    assert len(gens) == 4 and all(isinstance(s["resps"][0][0], str) for s in gens)
