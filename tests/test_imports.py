"""Package boundaries: the gateway runs without torch, no module imports itself back
through another, and every import goes a way the layers allow.

The torch check runs in a fresh interpreter (this one has torch loaded by other tests); the
cycle check only reads files.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level folders installed as `pdmesh.<name>` (pyproject's package-dir mapping).
PACKAGES = ("services", "gateway", "kvstore", "transports", "loadtest")


def _run_fresh(code: str, tmp_path: Path) -> dict:
    """Run `code` in a new interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gateway_imports_and_starts_without_torch(tmp_path: Path) -> None:
    """Importing the gateway, its `pdmesh serve gateway` entry, and building the Gateway
    (which loads the tokenizer of `tiny`) must not load torch: the gateway never runs the
    model."""
    out = _run_fresh("""
        import json, sys
        import pdmesh.services.ops.cli
        import pdmesh.gateway.app
        from pdmesh.services.ops.cli import SERVE
        from pdmesh.services.runtime.config import resolve
        assert SERVE["gateway"] == "pdmesh.gateway.app"
        assert callable(pdmesh.gateway.app.serve)
        after_import = "torch" in sys.modules
        gw = pdmesh.gateway.app.Gateway(resolve("gateway", {"model": "tiny"}, {}))
        print(json.dumps({"after_import": after_import, "after_init": "torch" in sys.modules,
                          "model": gw.model_name}))
    """, tmp_path)
    assert out == {"after_import": False, "after_init": False, "model": "tiny"}


def test_checkpoint_tokenizers_load_without_torch(tmp_path: Path) -> None:
    """The gateway's tokenizer for a .gguf file or a safetensors checkpoint directory is
    read from metadata only: no torch, no weights."""
    out = _run_fresh("""
        import json, sys
        from pathlib import Path

        import gguf
        from tokenizers import Tokenizer, models, pre_tokenizers

        from pdmesh.services.engine.checkpoint import load_tokenizer

        ckpt = Path("ckpt")
        ckpt.mkdir()
        core = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.save(str(ckpt / "tokenizer.json"))
        (ckpt / "config.json").write_text(json.dumps({"eos_token_id": 2}))
        st_tok, st_name = load_tokenizer(str(ckpt))

        writer = gguf.GGUFWriter("m.gguf", "llama")
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["a", "b", "<|im_end|>"])
        writer.add_token_types([1, 1, 3])
        writer.add_token_merges([])
        writer.add_eos_token_id(2)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        gg_tok, gg_name = load_tokenizer("m.gguf")

        print(json.dumps({"torch": "torch" in sys.modules,
                          "safetensors": [st_name, st_tok.encode("b a"),
                                          sorted(st_tok.eos_token_ids)],
                          "gguf": [gg_name, gg_tok.encode("<|im_end|>"),
                                   sorted(gg_tok.eos_token_ids)]}))
    """, tmp_path)
    assert out == {"torch": False, "safetensors": ["ckpt", [1, 0], [2]],
                   "gguf": ["m", [2], [2]]}


def test_torch_free_modules_do_not_import_torch(tmp_path: Path) -> None:
    """What torch-free processes (gateway, admission) share with the engine and the pool:
    model specs and tokenizers, the model geometry, and `pages_for`."""
    out = _run_fresh("""
        import json, sys
        import pdmesh.services.engine
        import pdmesh.services.engine.checkpoint
        import pdmesh.services.engine.config
        import pdmesh.services.engine.families
        import pdmesh.services.engine.tokenizer
        import pdmesh.kvstore.spec
        import pdmesh.services.admission.service
        print(json.dumps({"torch": "torch" in sys.modules}))
    """, tmp_path)
    assert out == {"torch": False}


# -- import cycles ---------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pdmesh", *parts])


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run (or type-checked) when the module is imported: those of the
    module body, including inside `if TYPE_CHECKING:`/`try:` blocks, but not inside
    functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    stack.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return found


def _all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, function-local ones included."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def _import_graph(function_local: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (module level, or anywhere)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    imports_of = _all_imports if function_local else _module_level_imports
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in imports_of(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".")
                    anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the module pkg.mod, `from mod import name` mod.
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if colour[root] != WHITE:
            continue
        path = [root]
        iters = [iter(sorted(graph[root]))]
        colour[root] = GREY
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                iters.pop()
            elif colour[nxt] == GREY:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_the_gateway() -> None:
    graph = _import_graph()
    assert "pdmesh.gateway.generation" in graph["pdmesh.gateway.app"]
    # `from pkg import mod` imports the module pkg.mod
    assert "pdmesh.services.protocol.messages" in graph["pdmesh.gateway.app"]


def test_no_import_cycles() -> None:
    """No module of services, gateway, kvstore, transports or loadtest imports, at module
    level (type-checking imports included), a module that imports it back."""
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_hidden_in_functions() -> None:
    """Nor does a function-local import close a cycle (the old way around one, e.g.
    engine.models importing the loaders that import it, inside `load_model`)."""
    cycle = _find_cycle(_import_graph(function_local=True))
    assert cycle is None, "import cycle through a function-local import: " + " -> ".join(
        cycle or [])


# -- layer directions ------------------------------------------------------------------------
# Which packages each package may import (docs/DESIGN.md "Allowed import directions"); a
# module matches the longest prefix listed. `services.protocol` (the wire contract, errors,
# lifecycle, tickets, capacity rules) and `kvstore.spec` (page arithmetic) are open to all.
_OPEN = ("pdmesh.services.protocol", "pdmesh.kvstore.spec")
_TORCH_FREE_ENGINE = ("pdmesh.services.engine.config", "pdmesh.services.engine.tokenizer",
                      "pdmesh.services.engine.checkpoint", "pdmesh.services.engine.families",
                      "pdmesh.services.engine.grammar")
_WORKER_BASE = ("pdmesh.services.runtime", "pdmesh.services.engine", "pdmesh.kvstore",
                "pdmesh.transports")
_WORKER_DEPS = (*_WORKER_BASE, "pdmesh.services.faults")  # a role's serve() wires faults
LAYERS: dict[str, tuple[str, ...]] = {
    "pdmesh.kvstore": ("pdmesh.kvstore",),
    "pdmesh.transports": ("pdmesh.transports",),
    "pdmesh.services.protocol": ("pdmesh.services.protocol",),
    "pdmesh.services.engine": ("pdmesh.services.engine", "pdmesh.kvstore"),
    "pdmesh.services.runtime.settings": ("pdmesh.services.runtime.settings",),
    "pdmesh.services.runtime.redact": ("pdmesh.services.runtime.redact",),
    "pdmesh.services.runtime.config": ("pdmesh.services.runtime.config",
                                       "pdmesh.services.runtime.settings",
                                       "pdmesh.services.runtime.redact"),
    "pdmesh.services.runtime.edge": ("pdmesh.services.runtime.edge",),
    "pdmesh.services.runtime.ptrace": ("pdmesh.services.runtime.ptrace",),
    "pdmesh.services.runtime.tracing": ("pdmesh.services.runtime.tracing",),
    "pdmesh.services.runtime.service": ("pdmesh.services.runtime.config",
                                        "pdmesh.services.runtime.edge",
                                        "pdmesh.services.runtime.ptrace",
                                        "pdmesh.services.runtime.tracing"),
    "pdmesh.services.runtime.worker": _WORKER_BASE,
    "pdmesh.services.faults": ("pdmesh.services.runtime.config", "pdmesh.transports",
                               "pdmesh.services.admission.policy"),
    "pdmesh.services.admission": ("pdmesh.services.admission", "pdmesh.services.runtime.config",
                                  "pdmesh.services.runtime.service", "pdmesh.services.faults",
                                  "pdmesh.services.runtime.tracing",
                                  "pdmesh.kvstore.prefix_key"),
    "pdmesh.services.prefill": ("pdmesh.services.prefill", *_WORKER_DEPS),
    "pdmesh.services.decode": ("pdmesh.services.decode", *_WORKER_DEPS),
    "pdmesh.services.colocated": ("pdmesh.services.colocated", "pdmesh.services.decode",
                                  *_WORKER_DEPS),
    "pdmesh.gateway": ("pdmesh.gateway", "pdmesh.services.runtime.config",
                       "pdmesh.services.runtime.service", "pdmesh.services.runtime.tracing",
                       "pdmesh.services.admission.policy",
                       "pdmesh.services.admission.registry", "pdmesh.services.faults",
                       *_TORCH_FREE_ENGINE),
    "pdmesh.services.ops": ("pdmesh",),
    "pdmesh.loadtest": ("pdmesh",),
}


def _layer_of(module: str) -> str | None:
    matches = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def _allowed(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in (*prefixes, *_OPEN))


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        layer = _layer_of(module)
        for target in sorted(targets):
            # `from pdmesh.services import faults` also names the package itself
            if target in ("pdmesh.services", "pdmesh") or _layer_of(target) == layer:
                continue
            if layer is None or not _allowed(target, LAYERS[layer]):
                found.append(f"{module} imports {target}")
    return found


def test_every_module_has_a_layer() -> None:
    # the two package docstrings that hold no code
    unplaced = sorted(m for m in _import_graph() if _layer_of(m) is None
                      and m not in ("pdmesh.services", "pdmesh.services.runtime"))
    assert unplaced == [], f"modules outside every layer of LAYERS: {unplaced}"


def test_the_layer_check_finds_a_wrong_direction() -> None:
    assert _layer_violations({"pdmesh.kvstore.pool": {"pdmesh.services.runtime.service"},
                              "pdmesh.services.protocol.messages": {"pdmesh.kvstore.spec"}}) == [
        "pdmesh.kvstore.pool imports pdmesh.services.runtime.service"]


def test_imports_follow_the_layer_directions() -> None:
    """Every import, function-local ones included, goes the way docs/DESIGN.md allows: the
    contract below everything, the runtime below the roles, no role importing ops or the
    tools, the gateway never the torch part of the engine."""
    violations = _layer_violations(_import_graph(function_local=True))
    assert violations == [], "\n".join(violations)
