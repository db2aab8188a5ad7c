"""Outside ``config/``, ``arguments/`` and ``checkpoint/``, nothing reads the run's flat arguments by name:
neither the Megatron-style argument namespace (``args.seq_length``) nor the saved flat dictionary,
``config.yaml`` (``saved["num_layers"]``, ``a.get("seq_length")``). ``config`` reads the flat form into the
typed ``RunConfig`` (and writes it back), ``arguments`` parses into it, ``checkpoint`` still checks the saved
form by key; everything else reads typed fields: ``RunConfig``'s groups, megatron-core's
``TransformerConfig``, ``LevModelConfig``, ``LEVConfig`` and ``TokenizerSpec``.

The rule, checked on the sources (AST, no run). A value *is the flat arguments* when it is

- the ``args`` attribute of anything (``open_checkpoint(...).args``: ``SavedCheckpoint.args`` is the one
  attribute of that name in the package), or
- returned by a function that makes or re-lays-out the flat form (:data:`SOURCES`: ``layout_args``,
  ``parse_args``, ``resolved_config``, ``RunConfig.to_saved_args``, ...), or
- built from such a value (``dict(a, ...)``, ``{**a}``, ``vars(a)``, ``a.copy()``), or
- assigned from one of these (tuple unpacking included), returned by a function of the walked modules (its
  calls are then sources), or passed to a parameter of such a function (a call by name, or by
  ``run_ranks(fn, args=(...))``),

followed to a fixed point over every module outside ``config/``, ``arguments/`` and ``checkpoint/``. A *read* of such a
value is a constant key (``a["x"]``, ``a.get("x")``, ``a.pop("x")``, ``getattr(a, "x")``, ``"x" in a``),
an attribute that is an argument's name (``args.seq_length``), or a call handing it on together with an
argument's name (``helper(a, "normalization")``). Everything else a module reads by string key
(JSON result files, Hugging Face ``config.json``, state dicts, a checkpoint's common state) is not the flat
arguments and stays free. Handing the flat form on whole (to ``RunConfig.from_saved_args``,
``save_checkpoint(config=...)``) or writing a key is not a read.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_lev"
EXEMPT = ("arguments", "checkpoint", "config")

# Functions (by name) whose result is the flat arguments. ``parse_args`` called by its bare name is
# ``megatron_lev.arguments.parse_args``; ``parser.parse_args(...)`` is a tool's own command line.
SOURCES = {"layout_args", "parse_args", "resolved_config", "load_yaml_config", "to_saved_args"}
OWN_PARSERS = {"parse_args"}
# Calls that copy the flat arguments they are given.
COPIES = {"dict", "vars", "copy", "deepcopy"}
KEY_METHODS = {"get", "pop", "setdefault"}


def _names() -> Set[str]:
    """Every argument name the flat form holds (the parser's destinations and the derived values)."""
    from megatron_lev.arguments import build_parser
    from megatron_lev.config import flat_names

    return {a.dest for a in build_parser()._actions} | set(flat_names())


@dataclass
class _Function:
    node: ast.AST
    module: str
    params: List[str]
    vararg: Optional[str]
    tainted: Set[str] = field(default_factory=set)
    returns: Set[object] = field(default_factory=set)  # "all" or tuple positions that are the flat arguments


def _functions(tree: ast.AST, module: str) -> List[_Function]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            out.append(_Function(node, module, params, a.vararg.arg if a.vararg else None))
    return out


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of ``fn``'s body, not descending into nested functions (they are functions of their own)."""
    stack = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)


def _callee(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


class _Walk:
    def __init__(self, modules: Dict[str, ast.AST]):
        self.modules = modules
        self.functions = [f for m, tree in modules.items() for f in _functions(tree, m)]
        self.by_name: Dict[str, List[_Function]] = {}
        for f in self.functions:
            if not isinstance(f.node, ast.Lambda):
                self.by_name.setdefault(f.node.name, []).append(f)

    # ---------------------------------------------------------------- what a value is
    def flat(self, node: ast.AST, fn: _Function) -> bool:
        """``node`` is the flat arguments (in function ``fn``)."""
        if isinstance(node, ast.Name):
            return node.id in fn.tainted
        if isinstance(node, ast.Attribute):
            return node.attr == "args" and not (isinstance(node.value, ast.Name) and node.value.id == "self")
        if isinstance(node, ast.Dict):
            return any(k is None and self.flat(v, fn) for k, v in zip(node.keys, node.values))
        if isinstance(node, ast.Call):
            name = _callee(node)
            if name in SOURCES and not (name in OWN_PARSERS and isinstance(node.func, ast.Attribute)):
                return True
            if name in COPIES:
                receiver = node.func.value if isinstance(node.func, ast.Attribute) and name == "copy" else None
                return (receiver is not None and self.flat(receiver, fn)) or any(self.flat(a, fn) for a in node.args[:1])
            return any("all" in f.returns for f in self.by_name.get(name, []))
        if isinstance(node, ast.IfExp):
            return self.flat(node.body, fn) or self.flat(node.orelse, fn)
        if isinstance(node, ast.BoolOp):
            return any(self.flat(v, fn) for v in node.values)
        return False

    def _tuple_positions(self, node: ast.AST) -> Set[int]:
        if isinstance(node, ast.Call):
            return {p for f in self.by_name.get(_callee(node), []) for p in f.returns if isinstance(p, int)}
        return set()

    # ---------------------------------------------------------------- propagation
    def _taint(self, fn: _Function, name: str) -> bool:
        if name in fn.tainted:
            return False
        fn.tainted.add(name)
        return True

    def _assign(self, fn: _Function, target: ast.AST, value: ast.AST) -> bool:
        changed = False
        if isinstance(target, ast.Name) and self.flat(value, fn):
            changed |= self._taint(fn, target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)):
                for t, v in zip(target.elts, value.elts):
                    changed |= self._assign(fn, t, v)
            else:
                for i in self._tuple_positions(value):
                    if i < len(target.elts) and isinstance(target.elts[i], ast.Name):
                        changed |= self._taint(fn, target.elts[i].id)
        return changed

    def _pass(self, callee: str, args: List[ast.AST], keywords: List[ast.keyword], fn: _Function) -> bool:
        changed = False
        for target in self.by_name.get(callee, []):
            params = list(target.params)
            if params and params[0] in ("self", "cls") and isinstance(target.node, ast.FunctionDef):
                params = params[1:]
            for i, a in enumerate(args):
                if isinstance(a, ast.Starred) or not self.flat(a, fn):
                    continue
                name = params[i] if i < len(params) else target.vararg
                if name:
                    changed |= self._taint(target, name)
            for k in keywords:
                if k.arg in target.params and self.flat(k.value, fn):
                    changed |= self._taint(target, k.arg)
        return changed

    def step(self) -> bool:
        changed = False
        for fn in self.functions:
            for node in _own_nodes(fn.node):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        changed |= self._assign(fn, target, node.value)
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    changed |= self._assign(fn, node.target, node.value)
                elif isinstance(node, ast.Return) and node.value is not None:
                    if self.flat(node.value, fn) and "all" not in fn.returns:
                        fn.returns.add("all")
                        changed = True
                    elif isinstance(node.value, ast.Tuple):
                        for i, v in enumerate(node.value.elts):
                            if self.flat(v, fn) and i not in fn.returns:
                                fn.returns.add(i)
                                changed = True
                elif isinstance(node, ast.Call):
                    changed |= self._pass(_callee(node), node.args, node.keywords, fn)
                    # run_ranks(fn, ..., args=(...)): the tuple is fn's positional arguments
                    target = next((a for a in node.args[:1] if isinstance(a, ast.Name)), None)
                    given = next((k.value for k in node.keywords if k.arg == "args"), None)
                    if target is not None and isinstance(given, ast.Tuple):
                        changed |= self._pass(target.id, given.elts, [], fn)
            if isinstance(fn.node, ast.Lambda) and self.flat(fn.node.body, fn) and "all" not in fn.returns:
                fn.returns.add("all")
                changed = True
        return changed

    # ---------------------------------------------------------------- reads
    def reads(self, names: Set[str]) -> List[Tuple[str, int, str]]:
        while self.step():
            pass
        out = []
        for fn in self.functions:
            for node in _own_nodes(fn.node):
                if self._is_read(node, fn, names):
                    out.append((fn.module, node.lineno, ast.unparse(node)))
        return sorted(set(out))

    def _is_read(self, node: ast.AST, fn: _Function, names: Set[str]) -> bool:
        def key(n):
            return isinstance(n, ast.Constant) and isinstance(n.value, str)

        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            return key(node.slice) and self.flat(node.value, fn)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            return node.attr in names and self.flat(node.value, fn)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            return key(node.left) and self.flat(node.comparators[0], fn)
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in KEY_METHODS and node.args and key(node.args[0]):
                return self.flat(f.value, fn)
            if getattr(f, "id", None) in ("getattr", "hasattr") and len(node.args) >= 2 and key(node.args[1]):
                return self.flat(node.args[0], fn)
            given = node.args + [k.value for k in node.keywords]
            return any(self.flat(a, fn) for a in given) and any(key(a) and a.value in names for a in given)
        return False


def _walked() -> Dict[str, ast.AST]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] not in EXEMPT:
            out[str(rel)] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def flat_reads(modules: Dict[str, ast.AST], names: Optional[Set[str]] = None) -> List[Tuple[str, int, str]]:
    """(module, line, code) of every read of the flat arguments in ``modules`` (see the module docstring)."""
    return _Walk(modules).reads(_names() if names is None else names)


def test_nothing_outside_config_arguments_and_checkpoint_reads_the_flat_arguments_by_name():
    reads = flat_reads(_walked())
    assert not reads, ("read the typed configuration (RunConfig's groups; TransformerConfig, LevModelConfig, LEVConfig, "
                       "TokenizerSpec), not the flat arguments by name: "
                       + "; ".join(f"megatron_lev/{m}:{line}: {code}" for m, line, code in reads))


WALKED = '''
import json
from megatron_lev.checkpoint import open_checkpoint
from megatron_lev.conversion.model_io import layout_args
from megatron_lev.arguments import parse_args

def evaluate(path, flags):
    ckpt = open_checkpoint(path)
    a = layout_args(ckpt.args, 1, 1)
    b = dict(a, seed=3)
    n = b["num_layers"]
    opts = {"dtype": "float32"}
    results = json.load(open("results.json"))
    return helper(a, opts, results["ppl"]), opts["dtype"], results.get("tasks"), ckpt.args.get("seq_length")

def helper(saved, opts, ppl):
    rows = opts.get("rows")
    run_ranks(rank, args=(saved, ppl))
    return saved_model_arg(saved, "normalization"), "lev_heads" in saved, rows

def rank(a, ppl):
    return a["padded_vocab_size"], ppl["x"]

def loaded(path):
    return open_checkpoint(path).args, path

def reader(path):
    saved, where = loaded(path)
    ns, own = parse_args(["--lr", "1"]), build_parser().parse_args(["--load", path])
    return saved.get("seq_length"), where["x"], ns.lr, getattr(ns, "seed"), ns.unknown_attribute, own.seed
'''


def test_the_walk_tells_the_flat_arguments_from_other_string_keyed_reads():
    reads = [code for _m, _line, code in flat_reads({"m.py": ast.parse(WALKED)}, {
        "num_layers", "seq_length", "normalization", "lev_heads", "padded_vocab_size", "lr", "seed"})]
    assert sorted(reads) == sorted([
        "b['num_layers']", "ckpt.args.get('seq_length')",  # from layout_args; open_checkpoint(...).args
        "saved_model_arg(saved, 'normalization')", "'lev_heads' in saved",  # a parameter given it
        "a['padded_vocab_size']",  # through run_ranks(fn, args=(...))
        "saved.get('seq_length')",  # returned in a tuple
        "ns.lr", "getattr(ns, 'seed')"])  # the namespace parse_args makes
