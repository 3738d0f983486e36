"""Loading a run config: YAML 1.2 without duplicate keys, ``--set`` overrides, the resolved config of a run folder."""

from __future__ import annotations

import difflib
import json
import re
import shlex
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from ortflow.config.base import RESOLVED_CONFIG_NAME, ConfigError, regular_file_problem
from ortflow.config.run import RunConfig
from ortflow.config.sealed import CONFIG_RECORD, ConfigChanged, RunFileDamaged, record_config, verify_config

# ---------------------------------------------------------------------------------------------------------------------
# YAML
#
# PyYAML follows YAML 1.1, where ``1:30`` is the number 90 (base 60), ``010`` is 8 (octal) and a key given twice
# silently keeps its last value. A config written by a person means none of these, so configs load with plain scalars
# resolved by the YAML 1.2 core schema (``010`` is 10, ``0o10`` is 8, ``1:30`` stays text for the field to refuse) and
# a mapping that names a key twice is refused, naming the key and both lines.

#: Configs are a few kilobytes; anything this large is a mistake (a data file given as the config, a huge comment).
#: The pure-Python parser (whose errors quote the offending line) reads this much in about half a second.
MAX_CONFIG_BYTES = 1 << 20


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice."""


def _core_schema_resolvers() -> dict:
    """PyYAML's implicit resolvers with the YAML 1.1 bool/int/float rules replaced by YAML 1.2 core schema ones."""
    kept = {
        first: [(tag, regexp) for tag, regexp in entries
                if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
        for first, entries in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
    }
    rules = [
        ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"),
        ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), "-+0123456789"),
        ("tag:yaml.org,2002:float", re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
         "-+.0123456789"),
    ]
    for tag, regexp, firsts in rules:
        for first in firsts:
            kept.setdefault(first, []).append((tag, regexp))
    return kept


class _StrictConstructor(yaml.constructor.SafeConstructor):
    """Safe construction with YAML 1.2 numbers, refusing duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the constructor names it
                continue
            if line != key_node.start_mark.line + 1:
                raise DuplicateKeyError(
                    f"the key '{key}' appears twice (lines {line} and {key_node.start_mark.line + 1}); the second "
                    f"would silently replace the first: keep one"
                )
        return super().construct_mapping(node, deep=deep)


def _int_1_2(loader: _StrictConstructor, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text)  # decimal, leading zeros included: 010 is ten


def _float_1_2(loader: _StrictConstructor, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith(".inf"):
        return float("-inf") if text.startswith("-") else float("inf")
    return float("nan") if text == ".nan" else float(text)


_StrictConstructor.add_constructor("tag:yaml.org,2002:int", _int_1_2)
_StrictConstructor.add_constructor("tag:yaml.org,2002:float", _float_1_2)


class _StrictLoader(yaml.SafeLoader, _StrictConstructor):
    """Safe loading with YAML 1.2 numbers and booleans, refusing duplicate keys (the pure-Python parser)."""

    yaml_implicit_resolvers = _core_schema_resolvers()


if yaml.__with_libyaml__:
    from yaml.cyaml import CParser

    class _StrictCLoader(CParser, _StrictConstructor, yaml.resolver.Resolver):
        """:class:`_StrictLoader` over libyaml's parser: the same resolvers and constructors in a tenth of the time
        (every rank and most commands load a config)."""

        yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers

        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            _StrictConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)


def load_yaml(text: str) -> Any:
    """Parse one YAML document with :class:`_StrictLoader` (YAML 1.2 numbers and booleans, no duplicate keys).

    libyaml parses it when PyYAML has it; text it refuses is parsed again by the pure-Python parser, whose errors quote
    the offending line.

    Raises:
        yaml.YAMLError: the text is not valid YAML, or a mapping names a key twice (:class:`DuplicateKeyError`).
    """
    if yaml.__with_libyaml__:
        try:
            data = yaml.load(text, Loader=_StrictCLoader)  # noqa: S506 - a SafeLoader's constructors
        except DuplicateKeyError:
            raise
        except yaml.YAMLError:
            pass
        else:
            if _nesting(data) <= _MAX_PLAIN_NESTING:  # deeper: the Python parser decides, as it always did
                return data
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


#: Configs nest a few levels; libyaml's result is taken up to this depth (the Python parser runs out of stack at a few
#: hundred, which load_config reports as "nested too deeply").
_MAX_PLAIN_NESTING = 64


def _nesting(data: Any) -> int:
    """How many mappings and sequences deep ``data`` nests (iteratively: no recursion limit)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            todo += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError([f"--set {dotted}: '{key}' is a value, not a section"])
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Parse ``a.b=c`` overrides; values are read as YAML scalars/lists (``3`` -> int, ``[a, b]`` -> list)."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set '{item}': expected KEY=VALUE, e.g. train.batch_size=8"])
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            problem = str(err).replace("\n", " ")
            raise ConfigError([f"--set '{item}': the value is not valid YAML ({problem}); {_quoting_hint(key, raw)}"]) \
                from None
        parsed.append((key.strip(), value))
    return parsed


def _quoting_hint(key: str, raw: str) -> str:
    """How to quote a ``--set`` value YAML refuses (a ``*`` or ``&`` that starts a word, a ``:`` in a list item).

    A whole list in quotes would be one string: a flat list gets each item quoted, in the exact ``--set`` to type.
    """
    text = raw.strip()
    if text.startswith("[") and text.endswith("]"):
        items = [item.strip() for item in text[1:-1].split(",")]
        if all(item and not any(c in item for c in "[]{}\"'\\") for item in items):
            quoted = ", ".join(json.dumps(item) for item in items)
            return f"quote each item: --set {shlex.quote(f'{key.strip()}=[{quoted}]')}"
        return f"quote each item of the list in double quotes: --set '{key.strip()}=[\"...\", \"...\"]'"
    return f"quote it: {key}='\"...\"'"


#: torch.optim's argument names, which docs/training.md compares the rules with, -> the optimizer section's fields.
_TORCH_NAMES = {"lr": ("learning_rate",), "betas": ("beta1", "beta2"), "eps": ("epsilon",)}


def _section_model(loc: tuple) -> type[BaseModel] | None:
    """The config model that holds the field at ``loc`` (a validation error's location), or None."""
    model: type[BaseModel] = RunConfig
    for key in loc[:-1]:
        if isinstance(key, int):
            continue  # an item of a list of sections: the model found for the list holds it
        field = model.model_fields.get(key)
        if field is None:
            return None
        found = [t for t in _types_in(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def _types_in(annotation: Any) -> list:
    """``annotation`` and the types inside it (``tuple[X, ...]``, ``X | None``, ``list[X]``)."""
    return [annotation, *(t for arg in get_args(annotation) for t in _types_in(arg))]


def _unknown_field(loc: tuple) -> str:
    """The message for a field the section does not have: the field meant, where one is close."""
    model, name = _section_model(loc), str(loc[-1])
    meant: tuple[str, ...] = ()
    if model is not None:
        fields = list(model.model_fields)
        meant = tuple(f for f in _TORCH_NAMES.get(name, ()) if f in fields) or tuple(
            difflib.get_close_matches(name, fields, n=1, cutoff=0.75))
    prefix = "".join(f"{p}." for p in loc[:-1])
    if not meant and len(loc) == 2:  # a field of another section (train.warmup_steps for lr_schedule.warmup_steps)
        sections = {key: _section_model((key, name)) for key in RunConfig.model_fields}
        meant = tuple(f"{key}.{name}" for key, model in sections.items() if model and name in model.model_fields)
        prefix = ""
    if not meant:
        return "unknown field; check the spelling (docs/config.md lists every field)"
    return f"unknown field; did you mean {' and '.join(prefix + m for m in meant)}?"


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown_field(tuple(e["loc"]))
        elif e["type"] == "missing":
            msg = "required field is missing"
        problems.extend(m if not loc or m.startswith(loc) else f"{loc}: {m}" for m in msg.split("\n"))
    return problems


def config_from_dict(raw: dict[str, Any], base_dir: Path | None = None, source: str | None = None) -> RunConfig:
    """Build a RunConfig from a plain dict, raising :class:`ConfigError` with every problem.

    Relative paths (``model.path``, ``data.train``, ``output_dir``, ...) resolve against ``base_dir`` (a config file's
    folder), else against the current folder now: the config holds absolute paths, which keep their meaning in every
    later step (configure builds in scratch folders) and in the run folder's stored config.
    """
    if not isinstance(raw, dict):
        problems = ["the config must be a YAML mapping of sections (name, output_dir, model, data, train, ...)"]
        raise ConfigError(problems, source)
    try:
        return RunConfig.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err), source) from None


def read_config_bytes(path: Path) -> bytes:
    """The bytes of a config file (a regular file of at most :data:`MAX_CONFIG_BYTES`)."""
    try:
        refusal = regular_file_problem(path, MAX_CONFIG_BYTES, "a config")
        if refusal and (path / RESOLVED_CONFIG_NAME).is_file():  # a run folder where its config was meant
            refusal += f" (a run folder's own config is {path / RESOLVED_CONFIG_NAME})"
        if refusal:
            raise ConfigError([refusal], str(path))
        return path.read_bytes()
    except OSError as err:
        raise ConfigError([f"cannot read config file: {err.strerror}; check the path"], str(path)) from None


def parse_config_bytes(data: bytes, path: Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """A config file's bytes as a dict (YAML, safe loader), with ``--set`` overrides applied; ``path`` names the file in
    errors."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            [f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the file as UTF-8"],
            str(path),
        ) from None
    try:
        raw = load_yaml(text) or {}
    except DuplicateKeyError as err:
        raise ConfigError([str(err)], str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], str(path)) from None
    except RecursionError:
        raise ConfigError(["nested too deeply to read (YAML nesting of hundreds of levels); flatten it"], str(path)) \
            from None
    if not isinstance(raw, dict):
        raise ConfigError(["the config must be a YAML mapping of sections"], str(path))
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    return raw


def read_config_dict(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read YAML with the safe loader and apply ``--set`` overrides."""
    path = Path(path)
    return parse_config_bytes(read_config_bytes(path), path, overrides)


def load_config(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load and validate a config file; relative paths resolve against its folder."""
    path = Path(path).resolve()
    return config_from_dict(read_config_dict(path, overrides), base_dir=path.parent, source=str(path))


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...], base_dir: Path | None = None) -> RunConfig:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated like the CLI's.

    Args:
        cfg: The config to start from.
        overrides: ``KEY=VALUE`` items (``train.num_train_steps=50``).
        base_dir: Folder that relative paths in the values resolve against (default: the current folder).

    Raises:
        ConfigError: an override is malformed or makes the config invalid.
    """
    if not overrides:
        return cfg
    raw = cfg.model_dump(mode="json")
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    return config_from_dict(raw, base_dir=base_dir, source="overrides " + " ".join(overrides))


def _relative_to(value: Any, folder: Path) -> Any:
    """``value`` (a dumped config tree) with every absolute path inside ``folder`` made relative to it."""
    if isinstance(value, dict):
        return {k: _relative_to(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_relative_to(v, folder) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        if path == folder or folder in path.parents:
            return path.relative_to(folder).as_posix()
    return value


def dump_config(cfg: RunConfig, folder: Path | None = None) -> str:
    """The resolved config as YAML, loadable by :func:`load_config` from a file in ``folder`` (default: the run
    folder, ``cfg.output_dir``): paths inside that folder are relative to it (``output_dir: .``, so a moved or copied
    run folder keeps working), the others absolute."""
    return yaml.safe_dump(_relative_to(cfg.model_dump(mode="json"), Path(folder or cfg.output_dir)), sort_keys=False)


def write_resolved_config(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """Write the resolved config into the run folder (atomically) and return its path."""
    run_dir = Path(run_dir or cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_CONFIG_NAME
    if target.exists() and not any((run_dir / name).exists() for name in (CONFIG_RECORD, "configure.json")):
        raise ConfigError([f"output_dir: {target} exists and ortflow did not write it (your own config?); configure "
                           "never writes over it: choose an output_dir of its own (e.g. runs/NAME)"])
    tmp = target.with_suffix(".yaml.tmp")
    try:
        tmp.write_text(dump_config(cfg, run_dir))
        tmp.replace(target)
        record_config(run_dir)  # every reader verifies config.yaml against this record
    finally:  # a full disk leaves no half-written file beside the config
        tmp.unlink(missing_ok=True)
    return target


def config_file_given(path: Path) -> str:
    """What to say where a command that takes a run folder (or one of its checkpoint folders) was given a file: the
    steps and the run folder, when the file is a config."""
    try:
        cfg = load_config(path)
    except (ConfigError, OSError, UnicodeDecodeError):
        return f"{path} is a file, not a run folder: give the folder that `ortflow configure CONFIG` writes"
    if (cfg.output_dir / RESOLVED_CONFIG_NAME).exists():
        return f"{path} is a config file, not a run folder: give its run folder {cfg.output_dir}"
    return (f"{path} is a config file, not a run folder: run `ortflow configure {path}` and `ortflow prepare-data "
            f"{path}`, then give its run folder {cfg.output_dir}")


def load_run_config(run_dir: Path | str, accept_changed: bool = False) -> RunConfig:
    """Load the resolved config a configured run folder holds (what every rank does at start), verified first
    against the record its writer left (:mod:`.sealed`).

    Args:
        run_dir: The run folder.
        accept_changed: Take a ``config.yaml`` that differs from its record as it is (``--accept-changed-config``);
            the caller records it again once it has checked that the change is safe.

    Raises:
        ConfigError: no config.yaml, it differs from its record or the record is damaged (file, expected, fix), or the
            config is invalid.
    """
    if Path(run_dir).is_file():
        raise ConfigError([config_file_given(Path(run_dir))], str(run_dir))
    path = (Path(run_dir) / RESOLVED_CONFIG_NAME).resolve()
    if not path.exists():
        raise ConfigError([f"{Path(run_dir) / RESOLVED_CONFIG_NAME} does not exist: run `ortflow configure CONFIG` "
                           "first"], str(run_dir))
    data = read_config_bytes(path)  # read once: the bytes verified are the bytes parsed
    try:
        verify_config(Path(run_dir), data)
    except ConfigChanged as err:
        if not accept_changed:
            raise ConfigError([str(err)], str(run_dir)) from None
    except RunFileDamaged as err:
        raise ConfigError([str(err)], str(run_dir)) from None
    return config_from_dict(parse_config_bytes(data, path), base_dir=path.parent, source=str(path))
