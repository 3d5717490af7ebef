"""Rules the source keeps, checked on the source itself: the layers (from the import
graph), no import cycle, protobuf only at the edges, environment variables read in one
place per layer, file sizes, methods defined in their classes, and no task left
without a reference.

The layers, bottom to top (docs/ARCHITECTURE.md draws them):

    engine, kvtransfer          libraries: no serving code
    baton.wire                  the wire contract: stubs, records, conversion
    baton.runtime               server and worker bases, settings, clients, tracing, metrics
    gateway, prefill_worker,    the roles
    decode_worker
    baton.cli                   the command line: the only importer of the roles
    baton.devtools              dev and test tooling: imported by no serving code
"""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("baton", "engine", "gateway", "prefill_worker", "decode_worker", "kvtransfer")
ROLES = ("gateway", "prefill_worker", "decode_worker")
# What "model, attention or kernel code" is: the packages and modules that run or build the model.
MODEL_CODE = ("engine.model", "engine.attention", "engine.kernels", "engine.runner", "engine.sampling",
              "engine.engine", "engine.llm", "engine.async_engine")
# All the gateway may load of the libraries: records, the tokenizer and the detokenizer
# (and the dummy models' table, for their tokenizer's vocabulary).
GATEWAY_LIBRARY = {
    "engine", "engine.lazy", "engine.errors", "engine.config", "engine.sampling_params", "engine.structured_output", "engine.outputs",
    "engine.tokenizer",
    "engine.dummy_models", "engine.kv", "engine.kv.prefix_hash",  # the gateway hashes prompt blocks as workers do (prefix affinity)
    "engine.detokenizer", "engine.scheduler", "engine.scheduler.stats", "engine.statistics", "engine.scheduler.preemption",
    "engine.timeline",
    "kvtransfer", "kvtransfer.layout", "kvtransfer.transport", "kvtransfer.endpoint",  # records read by the gateway; no torch
}
# The modules that may build or read protobuf messages: the conversion module, and the
# servicers (which hand messages between grpc and it).
PROTOBUF_EDGE = {
    "baton.wire.convert", "baton.wire.kv_convert", "baton.wire.stats_convert", "baton.wire.status",
    "gateway.service", "gateway.admin", "gateway.server",
    "prefill_worker.server", "decode_worker.server",
}
# The modules that call or register gRPC services: the clients, and the servicers.
GRPC_EDGE = (PROTOBUF_EDGE - {"baton.wire.convert", "baton.wire.kv_convert", "baton.wire.stats_convert",
                               "baton.wire.status"}
             | {"baton.runtime.clients"})
# A file past SOFT_MAX_LINES is asking to be split along a seam (a warning); past MAX_LINES, it must.
SOFT_MAX_LINES = 600
MAX_LINES = 800
MAX_FUNCTION_LINES = 50  # in engine/ and gateway/, kernels excepted


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of the packages, generated stubs included, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def source_files() -> list[Path]:
    """Every hand-written Python file of the packages (generated stubs excluded)."""
    return sorted(path for path in modules().values() if "_pb2" not in path.name)


@cache
def imports(name: str) -> frozenset[str]:
    """The modules of ours `name` imports anywhere in its file (inside functions too), and
    the packages that importing it runs (a.b.c runs a and a.b first)."""
    known = modules()
    found = set()
    for node in _runtime_nodes(ast.parse(known[name].read_text(), str(known[name]))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # A package's lazily loaded names count as imports of the modules they live in.
            lazy = lazy_names(node.module)
            targets = [node.module] + [lazy.get(alias.name, f"{node.module}.{alias.name}") for alias in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # its packages run first
                if ".".join(parts[:i]) in known:
                    found.add(".".join(parts[:i]))
    parts = name.split(".")
    found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    found.discard(name)
    return frozenset(found)


@cache
def lazy_names(package: str) -> dict[str, str]:
    """A package's names loaded on first use (its __init__'s `_LOCATIONS`): name -> module."""
    path = modules().get(package)
    if path is None or path.name != "__init__.py":
        return {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_LOCATIONS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def _runtime_nodes(tree: ast.AST):
    """Every node, except under `if TYPE_CHECKING:` (imports for type checkers only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def reachable(name: str) -> set[str]:
    """Everything importing `name` may import, transitively."""
    seen, todo = set(), [name]
    while todo:
        for target in imports(todo.pop()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def within(name: str, *prefixes: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def edges(where: tuple[str, ...], to: tuple[str, ...]) -> list[str]:
    """Direct imports from modules under `where` into modules under `to`."""
    return sorted(f"{source} -> {target}" for source in modules() if within(source, *where)
                  for target in imports(source) if within(target, *to) and not within(source, *to))


def declared_imports(name: str) -> frozenset[str]:
    """The modules of ours `name` names in its import statements, type-checking-only ones
    included: `from a import b` is an import of a.b when b is a module, else of a (not of
    the packages an import runs: a package's modules import it by design)."""
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(known[name].read_text(), str(known[name]))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            lazy = lazy_names(node.module)
            targets = [lazy.get(alias.name, f"{node.module}.{alias.name}") for alias in node.names]
            targets = [target if target in known else node.module for target in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return frozenset(found)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of more than one node that reach each other (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def import_cycles(prefixes: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    """The cycles of declared imports among the modules under `prefixes`."""
    return strongly_connected({name: {t for t in declared_imports(name) if within(t, *prefixes)}
                               for name in modules() if within(name, *prefixes)})


def room(name: str) -> str:
    """A module's room: a top-level module of a package, or a sub-package whole
    (engine.kv.manager is in engine.kv; engine.request is its own)."""
    return ".".join(name.split(".")[:2])


def test_no_import_cycle_anywhere():
    """In the whole tree, type-checking imports included: a module that needs another's
    types only to annotate a back-reference is a cycle in the design (engine/scheduler/'s
    policies read an AdmissionView, its statistics a SchedulerState, not the Scheduler)."""
    assert import_cycles() == []


def test_no_import_cycle_between_rooms():
    """A sub-package is one room of its package, a top-level module another: no room
    imports one that imports it back (the layers within a package go one way)."""
    graph: dict[str, set[str]] = {}
    for name in modules():
        graph.setdefault(room(name), set()).update(room(t) for t in declared_imports(name) if room(t) != room(name))
    assert strongly_connected(graph) == []


def test_the_engine_top_level_is_what_callers_import():
    """docs/engine.md: a module at engine/'s top level is imported from outside the engine
    (or is a name the engine package hands on, or an entry point); machinery sits in a
    sub-package."""
    lazy = set(lazy_names("engine").values())
    top = [name for name, path in modules().items() if name.count(".") == 1 and within(name, "engine")
           and path.name != "__init__.py" and path.parent == REPO_ROOT / "engine"]
    callers = {t for name in modules() if not within(name, "engine") for t in declared_imports(name)}
    machinery = [name for name in top if name not in callers | lazy
                 and '__name__ == "__main__"' not in modules()[name].read_text()]
    assert machinery == []


def test_no_admission_policy_imports_the_scheduler():
    policies = ("engine.scheduler.policy", "engine.scheduler.continuous", "engine.scheduler.static")
    assert [p for p in policies if "engine.scheduler.scheduler" in declared_imports(p)] == []


# ------------------------------------------------------------------ layers
def test_libraries_import_no_serving_code():
    assert edges(("engine", "kvtransfer"), ("baton", *ROLES)) == []
    assert edges(("engine",), ("kvtransfer",)) == []  # kvtransfer sits on the engine's cache, not under it


def test_wire_and_runtime_import_no_layer_above_them():
    assert edges(("baton.wire",), ("baton.runtime", "baton.cli", "baton.devtools", *ROLES)) == []
    assert edges(("baton.runtime",), ("baton.cli", "baton.devtools", *ROLES)) == []


def test_only_the_command_line_imports_the_roles():
    for role in ROLES:
        others = tuple(r for r in ROLES if r != role)
        assert edges((role,), ("baton.cli", "baton.devtools", *others)) == []
    importers = {line.split(" -> ")[0] for line in edges(PACKAGES, ROLES)}
    assert importers and all(within(name, "baton.cli") for name in importers), importers


def test_no_serving_code_imports_the_dev_tooling():
    assert edges(PACKAGES, ("baton.devtools",)) == []


def test_imports_are_absolute_and_visible():
    """No relative imports, and no module imported by name except a package's lazy names
    (engine/lazy.py; the graph reads them from each package's `_LOCATIONS`): otherwise
    the graph above would miss edges."""
    hidden = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                hidden.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} relative import")
            by_name = (isinstance(node, ast.Attribute) and node.attr == "import_module"
                       or isinstance(node, ast.Name) and node.id == "__import__")
            if by_name and module_name(path) != "engine.lazy":  # the lazy names' loader
                hidden.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} import by name")
    assert hidden == []


def test_the_gateway_imports_a_tokenizer_not_a_model():
    """Statically (every import in the gateway's files, transitively) and for real (a
    fresh interpreter that imports the gateway's modules)."""
    gateway = [name for name in modules() if within(name, "gateway")]
    loaded = {target for name in gateway for target in reachable(name)}
    assert not [name for name in loaded if within(name, *MODEL_CODE)]
    libraries = {name for name in loaded if within(name, "engine", "kvtransfer")}
    assert libraries <= GATEWAY_LIBRARY, libraries - GATEWAY_LIBRARY
    script = (f"import sys; import {', '.join(gateway)}; "
              f"print('\\n'.join(m for m in sys.modules if m.startswith('engine')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    assert not [name for name in result.stdout.split() if within(name, *MODEL_CODE)], result.stdout


# ------------------------------------------------------------------ protobuf at the edges
def test_protobuf_messages_only_in_servicers_and_the_conversion_module():
    """Modules that import message definitions (x_pb2) are the edge; routing, the KV
    sender and receiver, the engine and kvtransfer work on records."""
    importers = {source for source in modules() if not source.endswith(("_pb2", "_pb2_grpc"))
                 for target in imports(source) if target.endswith("_pb2")}
    assert importers <= PROTOBUF_EDGE, importers - PROTOBUF_EDGE
    callers = {source for source in modules() if not source.endswith(("_pb2", "_pb2_grpc"))
               for target in imports(source) if target.endswith("_pb2_grpc")}
    assert callers <= GRPC_EDGE, callers - GRPC_EDGE
    # Nor reached through the conversion module's own imports.
    through = [f"{path.relative_to(REPO_ROOT)}:{node.lineno}" for path in source_files()
               if module_name(path) not in GRPC_EDGE | PROTOBUF_EDGE
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
               and getattr(node.value, "id", "") == "convert" and node.attr in ("pb", "worker_pb2", "json_format")]
    assert through == []
    for name in ("gateway.workers", "gateway.dispatch", "gateway.prepare", "prefill_worker.kv_sender",
                 "decode_worker.kv_receiver"):
        assert not [t for t in imports(name) if t.endswith(("_pb2", "_pb2_grpc"))], name


# ------------------------------------------------------------------ settings
def test_environment_variables_are_read_in_one_module_per_layer():
    """baton/runtime/settings.py for Baton's processes, engine/envs.py for the engine's own."""
    allowed = {"baton.runtime.settings", "engine.envs"}
    readers = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
            if name in ("environ", "getenv", "putenv", "unsetenv") and module_name(path) not in allowed:
                readers.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert readers == []


# ------------------------------------------------------------------ size and tasks
def test_no_hand_written_source_file_is_over_the_line_limits():
    """Past SOFT_MAX_LINES a warning (split it along a seam, the new file named for what it
    holds: STYLE.md); past MAX_LINES a failure."""
    files = [p for p in REPO_ROOT.rglob("*") if p.suffix in (".py", ".cpp", ".h", ".proto")
             and "_pb2" not in p.name
             and not {".git", "build", "node_modules"} & set(parts := p.relative_to(REPO_ROOT).parts)
             and not parts[0].startswith(".venv")]  # .venv, and make rehearse-gpu-stack's
    assert len(files) > 50
    lengths = {str(p.relative_to(REPO_ROOT)): len(p.read_text().splitlines()) for p in files}
    for path, n in sorted(lengths.items()):
        if SOFT_MAX_LINES < n <= MAX_LINES:
            warnings.warn(f"{path} has {n} lines: split it along a seam", stacklevel=1)
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}


def test_every_method_is_defined_in_its_class():
    """No function defined elsewhere and assigned into a class body (`run = run`): a method
    that changes its object's state lives with that state."""
    assigned = []
    for path in source_files():
        tree = ast.parse(path.read_text(), str(path))
        outside = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
        outside |= {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                assigned += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} {cls.name}.{ast.unparse(node)}"
                             for node in cls.body if isinstance(node, ast.Assign)
                             and isinstance(node.value, ast.Name) and node.value.id in outside]
    assert assigned == []


def test_no_function_in_the_engine_or_the_gateway_over_50_lines():
    """A function says one thing (its docstring and comments counted); the kernels, whose
    bodies are one launch's arithmetic, excepted."""
    long = {}
    for path in [*(REPO_ROOT / "engine").rglob("*.py"), *(REPO_ROOT / "gateway").rglob("*.py")]:
        if "kernels" in path.relative_to(REPO_ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}"] = length
    assert long == {}


def test_no_task_is_left_without_a_reference():
    """asyncio keeps only a weak reference to a task: one created and dropped may be
    collected mid-run. Every create_task / ensure_future result is kept (assigned,
    returned, awaited or passed on), never a bare expression statement."""
    dropped = []
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Expr):
                continue
            call = node.value  # also `create_task(...).add_done_callback(...)`: the task itself is dropped
            while isinstance(call, ast.Call):
                function = call.func
                name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
                if name in ("create_task", "ensure_future"):
                    dropped.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
                    break
                call = function.value if isinstance(function, ast.Attribute) else None
    assert not dropped, f"tasks created without a kept reference: {dropped}"


# Names vulture cannot see used, each for a reason.
NOT_DEAD = {
    "frame": "a signal handler's signature",
    "thread_event_loop": "an autouse pytest fixture",
    "exc_info": "__exit__'s signature",
    "Export": "a gRPC servicer method (the OTLP sink), called by grpc",
    "collect": "a prometheus_client Collector method, called at scrape time",
    "intercept_service": "a grpc.aio ServerInterceptor method, called by grpc",
    "sort_key": "read through a key function (_sort_key)",
    "_store": "keeps a rendezvous store alive as long as its channel",
    "_store_server": "keeps a rendezvous store alive as long as its channel",
    "__traceback__": "cleared so a failed transfer's frames free their buffers",
    "_timeout": "a torch.distributed backend option",
    "_devices": "a torch.distributed backend option",
    "is_high_priority_stream": "a torch.distributed backend option",
    "pytestmark": "read by pytest",
    "pytest_collection_modifyitems": "a pytest hook (conftest.py)",
    "free_gpu_memory": "an autouse pytest fixture",
    "cpu_kernels": "an autouse pytest fixture (tests/kernels/test_kernels.py)",
    "pytest_runtest_logstart": "a pytest hook (benchmarks/gpu_check/pytest_records.py)",
    "pytest_runtest_logreport": "a pytest hook (benchmarks/gpu_check/pytest_records.py)",
    "pytest_collectreport": "a pytest hook (benchmarks/gpu_check/pytest_records.py)",
    "pytest_collection_finish": "a pytest hook (benchmarks/gpu_check/pytest_records.py)",
    "pytest_xdist_node_collection_finished": "a pytest-xdist hook (benchmarks/gpu_check/pytest_records.py)",
    "location": "a pytest hook's signature",
    "pre_tokenizer": "a tokenizers.Tokenizer component, set for the library to read",
    "decoder": "a tokenizers.Tokenizer component, set for the library to read",
    "_invalid_body": "a FastAPI exception handler (gateway/http/app.py), registered by decorator",
    "_http_error": "a FastAPI exception handler (gateway/http/app.py), registered by decorator",
    "is_ready": "a FastAPI route (GET /ready), registered by decorator",
    "chat_completions": "a FastAPI route (POST /v1/chat/completions), registered by decorator",
    "model_config": "a pydantic model's configuration",
    "presence_penalty": "an OpenAI request field, read by name (gateway/http/translate.py _PARAMS_BY_NAME)",
    "frequency_penalty": "an OpenAI request field, read by name (gateway/http/translate.py _PARAMS_BY_NAME)",
    "logit_bias": "an OpenAI request field, read by name (gateway/http/translate.py _PARAMS_BY_NAME)",
    "response_format": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "best_of": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "echo": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "tools": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "tool_choice": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "functions": "an OpenAI request field, read by name (gateway/http/translate.py UNSUPPORTED)",
    "total_tokens": "an OpenAI response field, serialized for the client",
    "owned_by": "an OpenAI response field, serialized for the client",
    "capture_signals": "a uvicorn.Server method, overridden (gateway/http/server.py)",
    "should_exit": "uvicorn.Server's flag, read by its main loop",
    "extra_repr": "an nn.Module hook, read by its repr",
}


def test_no_dead_code():
    """Every function, class, attribute and variable is used somewhere (the packages, the
    tests or the benchmarks), by vulture's reading; the generated stubs are not checked."""
    import vulture

    # A hypothesis state machine's rules and invariants are called by hypothesis.
    scanner = vulture.Vulture(ignore_names=sorted(NOT_DEAD), ignore_decorators=["@rule", "@invariant"])
    scanner.scavenge([str(REPO_ROOT / p) for p in (*PACKAGES, "tests", "benchmarks")], exclude=["*_pb2*"])
    unused = [f"{Path(item.filename).relative_to(REPO_ROOT)}:{item.first_lineno} {item.message}"
              for item in scanner.get_unused_code(min_confidence=60)]
    assert unused == []
