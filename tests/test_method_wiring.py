"""A method owns its wiring: the registry is a table of the specs drafter modules export, the CLI
names no method and builds its method flags from the config fields, every config refuses bad
values with one line, and the flags' help says what they do for each method."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import pytest

import selfspec
from selfspec import cli, registry
from selfspec.cli import build_parser, main
from selfspec.drafters.spec import MethodSpec
from selfspec.errors import SelfspecError
from selfspec.options import flag_uses, method_options

CLI_SOURCE = "\n".join(f.read_text() for f in sorted(Path(cli.__file__).parent.glob("*.py")))
REQUIRED = {"draft-model": {"draft_model": "some-draft"}}  # options a config cannot do without


def _configs():
    return [(m, spec.config_cls) for m, spec in registry.METHODS.items()] + [(registry.AUTO, registry.AutoOptions)]


def test_cli_source_names_no_method():
    """No string literal of the cli package is a registered method's name (help text generated from the
    registry may name them; the code may not)."""
    names = set(registry.METHODS)
    literals = [n.value for n in ast.walk(ast.parse(CLI_SOURCE)) if isinstance(n, ast.Constant)
                and isinstance(n.value, str)]
    assert not names & set(literals), sorted(names & set(literals))


def test_autoselect_names_no_method():
    """``auto`` takes its candidates from the registry: no string literal of the autoselect package is a
    registered method's name, nor a label made of one (``ar@...``); docstrings aside."""
    import selfspec.autoselect as autoselect

    tree = ast.Module(body=[stmt for f in sorted(Path(autoselect.__file__).parent.glob("*.py"))
                            for stmt in ast.parse(f.read_text()).body], type_ignores=[])
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    literals = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and id(n) not in docstrings]
    names = set(registry.METHODS)
    assert not [v for v in literals if v in names or v.split("@")[0] in names], literals


def test_registry_is_the_table_of_the_drafters_specs():
    for name, spec in registry.METHODS.items():
        assert isinstance(spec, MethodSpec) and spec.name == name
        assert spec.config_cls.__module__.startswith("selfspec.drafters."), name
        assert spec.help and "\n" not in spec.help
        assert spec.lossless is ("NOT LOSSLESS" not in spec.help)
    assert selfspec.METHODS is registry.METHODS


def _numeric_fields(cls):
    return [f for f in dataclasses.fields(cls) if str(f.type).partition(" | ")[0] in ("int", "float")]


@pytest.mark.parametrize("method,cls", _configs(), ids=[m for m, _ in _configs()])
def test_every_config_validates_its_defaults_and_refuses_text_in_numbers(method, cls):
    cfg = registry.method_config(method, dict(REQUIRED.get(method, {})))
    assert isinstance(cfg, cls)
    for f in _numeric_fields(cls):
        with pytest.raises(SelfspecError) as e:
            registry.method_config(method, {**REQUIRED.get(method, {}), f.name: "many"})
        msg = str(e.value)
        assert "\n" not in msg and f.name in msg and "'many'" in msg, msg


@pytest.mark.parametrize("method,option,value", [
    ("pld", "k", 0), ("pld", "min_ngram", 0), ("pld", "max_ngram", 0),
    ("draft-model", "k", 0), ("draft-model", "min_confidence", 1.0), ("draft-model", "draft_model", ""),
    ("self-spec", "k", 0), ("self-spec", "draft_exit", "sometimes"), ("self-spec", "min_confidence", -0.1),
    ("eagle2", "top_k", 0), ("hass", "depth", -1), ("hass", "total_tokens", -1), ("eagle2", "max_tokens", 1),
    ("hass", "min_prob", 1.0),
    ("sdsat", "k", -1), ("sdsat-lossy", "max_k", 0), ("sdsat", "candidates", 0), ("sdsat", "tree", "1;x"),
    ("sdsat", "adaptive_ids", "five"),
    ("jacobi", "m", 0),
    ("msn", "tree_size", -1), ("msn", "max_nodes", 0), ("msn", "ngram", 0),
    ("space", "k", -1), ("space-lossy", "max_k", 0), ("space", "mask_id", -2),
])
def test_bad_values_are_refused_with_one_line_naming_the_option(method, option, value):
    with pytest.raises(SelfspecError) as e:
        registry.method_config(method, {**REQUIRED.get(method, {}), option: value})
    msg = str(e.value)
    assert "\n" not in msg and option.split("_")[0] in msg and method.split("-")[0] in msg, msg


def test_unknown_options_and_methods_are_named():
    with pytest.raises(SelfspecError, match="has no option 'nope'; its options are: auto_k, k"):
        registry.method_config("pld", {"nope": 1})
    with pytest.raises(SelfspecError, match="unknown method 'nope'; choose one of: auto, ar, msn, pld"):
        registry.method_config("nope", {})


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    found = [a for a in parser._actions if flag in a.option_strings]
    assert found, f"{parser.prog} has no flag {flag}"
    return found[0]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subs and name in subs[0].choices, f"{parser.prog} has no command {name}"
    return subs[0].choices[name]


@pytest.mark.parametrize("command", ["generate", "demo", "bench"])
def test_generated_flags_carry_each_fields_help(command):
    p = _subparser(build_parser(), command)
    for method, cls in _configs():
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                text = _action(p, f.metadata["flag"]).help.replace("%%", "%")
                assert method in text, (method, f.name)
                if "value" in f.metadata:  # a switch: one entry per field, with that field's shortest help
                    assert f"sets {f.name}" in text, (method, f.name)
                else:
                    assert f.metadata["help"] in text and f"({f.name}" in text, (method, f.name)


def test_every_existing_flag_spelling_is_kept():
    p = _subparser(build_parser(), "generate")
    for flag in ("--k", "--fixed-k", "--draft-model", "--skip-config", "--draft-exit", "--head", "--tree-tokens",
                 "--tree-top-k", "--tree-depth", "--sdsat-tree", "--adaptive-ids", "--mask-id"):
        _action(p, flag)


def _args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["generate", *argv, "prompt"])


def test_k_and_fixed_k_do_what_their_help_says():
    """Every method the help of --k names takes --k, into the field the help names; every
    method it does not name refuses it; likewise --fixed-k."""
    uses = flag_uses()
    k_help = _action(_subparser(build_parser(), "generate"), "--k").help
    for method, _ in _configs():
        k_fields = {u.field for u in uses["--k"] if u.method == method and u.when is None}
        if not k_fields:
            assert f"{method} (" not in k_help and f"{method}," not in k_help
            with pytest.raises(SelfspecError, match=f"--k is only used by .*, not --method {method}"):
                method_options(_args(["--method", method, "--k", "3"]), method)
            continue
        opts = method_options(_args(["--method", method, "--k", "3"]), method)
        assert {f for f, v in opts.items() if v == 3} == k_fields
        registry.method_config(method, {**REQUIRED.get(method, {}), **opts})
    fixed = {u.method for u in uses["--fixed-k"]} | {u.method for us in uses.values() for u in us
                                                      if u.when == "--fixed-k"}
    for method, _ in _configs():
        argv = ["--method", method, "--k", "3", "--fixed-k"]
        if method in fixed:
            opts = method_options(_args(argv), method)
            cfg = registry.method_config(method, {**REQUIRED.get(method, {}), **opts})
            assert 3 in dataclasses.asdict(cfg).values() and (False in opts.values() or method == "msn")
        else:
            with pytest.raises(SelfspecError, match="-k is only used by"):
                method_options(_args(argv), method)
    assert method_options(_args(["--k", "5", "--fixed-k"]), "msn") == {"tree_size": 5}
    assert method_options(_args(["--k", "5"]), "msn") == {"max_nodes": 5}
    assert method_options(_args(["--k", "5", "--fixed-k"]), "jacobi") == {"m": 5, "auto_m": False}
    assert method_options(_args(["--k", "2"]), "sdsat") == {"k": 2}


def test_bench_reads_the_flags_leniently():
    args = build_parser().parse_args(["bench", "--k", "4", "--head", "h"])
    assert method_options(args, "pld", strict=False) == {"k": 4}
    assert method_options(args, "hass", strict=False) == {"head": "h"}
    assert method_options(args, "ar", strict=False) == {}


@pytest.mark.parametrize("argv,where", [
    (["generate", "--bogus", "x"], "selfspec generate --help"),
    (["demo", "--bogus"], "selfspec demo --help"),
    (["models", "pull", "--bogus", "a"], "selfspec models pull --help"),
    (["--bogus", "generate", "x"], "selfspec --help"),
])
def test_unknown_options_point_to_the_help_of_their_command(capsys, argv, where):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --bogus" in err and f"(see {where})" in err, err


def test_a_spec_that_disagrees_with_its_drafter_is_refused():
    from selfspec.drafters.base import AR

    liar = dataclasses.replace(AR, lossless=False)
    with pytest.raises(RuntimeError, match="not lossless"):
        liar.build(None, None, None)


def test_draft_model_of():
    class G:
        class drafter:
            draft_model = "the module"

    assert registry.draft_model_of(G()) == "the module"
    assert registry.draft_model_of(object()) is None


def _readme_commands() -> list[list[str]]:
    """The ``selfspec ...`` command lines of the code blocks of the README and docs/usage.md (its
    longer list of examples), placeholders kept."""
    import shlex

    root = Path(__file__).parent.parent
    text = (root / "README.md").read_text() + (root / "docs" / "usage.md").read_text()
    blocks = text.split("```")[1::2]
    out, line = [], ""
    for raw in (x for b in blocks for x in b.splitlines()):
        line += " " + raw.split("  #")[0].strip().rstrip("\\")
        if raw.rstrip().endswith("\\"):
            continue
        if line.strip().startswith("selfspec "):
            out.append(shlex.split(line.replace("[", "").replace("]", ""))[1:])
        line = ""
    return out


def test_every_readme_command_parses_and_validates():
    cmds = _readme_commands()
    assert len(cmds) >= 20
    for argv in cmds:
        ns = build_parser().parse_args(argv)
        if getattr(ns, "method", None) and argv[0] != "tune":
            registry.method_config(ns.method, method_options(ns, ns.method))


def test_every_drafter_declares_its_request_state_and_sizer():
    """The Drafter protocol's explicit members (no reflection in the package): each drafter class
    has snapshot / restore over the attributes it names as adapting across requests, and says
    what sizes its drafts (``sizer``, None for fixed drafts; its profile is the one corrected online)."""
    import importlib
    import inspect

    names = ("base", "draft_model", "eagle", "jacobi", "msn", "prompt_lookup", "scripted", "sdsat", "self_spec",
             "space")
    modules = [importlib.import_module(f"selfspec.drafters.{n}") for n in names]
    classes = [c for mod in modules
               for _, c in inspect.getmembers(mod, inspect.isclass)
               if c.__module__ == mod.__name__ and hasattr(c, "propose")]
    assert len(classes) >= 10
    for c in classes:
        assert isinstance(c.request_state, tuple) and all(isinstance(n, str) for n in c.request_state), c
        assert callable(c.snapshot) and callable(c.restore), c
        init = inspect.getsource(c.__init__) if "__init__" in vars(c) else ""
        for name in c.request_state:  # each one is set at construction
            assert f"self.{name} =" in init or f"self.{name}," in init, (c, name)
        assert "sizer" in vars(c) or "self.sizer =" in init, c


def test_a_draft_through_a_compiled_step_of_its_own_is_declared_where_it_is_built():
    """``selfspec compile`` and the bench's warm-up build a drafter's own compiled steps through the
    protocol's ``warm_up`` (``DrafterBase``'s does nothing) for the methods whose registry line says
    ``draft_step``: the drafter classes that override ``warm_up`` are exactly those of a module whose
    spec declares it (self-spec's int8 draft), and every drafter class has the base."""
    import importlib
    import inspect

    from selfspec.decoding.protocol import DrafterBase

    overriding, declared = set(), set()
    for spec in registry.METHODS.values():
        module = importlib.import_module(spec.make.__module__)
        classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                   if c.__module__ == module.__name__ and hasattr(c, "propose")]
        for c in classes:
            assert issubclass(c, DrafterBase), c
            if c.warm_up is not DrafterBase.warm_up:
                overriding.add(module.__name__)
        if spec.draft_step:
            declared.add(module.__name__)
    assert declared == overriding == {"selfspec.drafters.self_spec"}
    assert DrafterBase().warm_up(512) == 0.0


def test_every_module_of_the_package_is_under_400_lines():
    """Files doing one job each (issue 33): a module past 400 lines is split by job, not grown."""
    src = Path(selfspec.__file__).parent
    long = {str(p.relative_to(src)): n for p in src.rglob("*.py") if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, long
