"""Typed structured configs: a dataclass schema's defaults <- a YAML file <- overrides.

Contract
--------
* ``load_structured(schema, path, overrides)`` merges ``defaults <- YAML <- overrides``
  with OmegaConf (unknown keys and wrong types refused) and builds the dataclass tree
  with ``build_structured``; every error is a ``ValueError`` naming the file (or
  "overrides") and the key as the user writes it (``rollout.bandit.epsilon``): a class
  names its fields ``ClassName.field`` and ``build_structured`` rewrites that to the key
  path where the class is nested.
* Overrides, as NeMo / Hydra users type them: ``key=value`` sets (under a mapping field it
  may add a key), ``+key=value`` adds a key only where the schema allows new keys (mapping
  fields) and refuses one that exists, ``++key=value`` adds or sets, ``~key`` removes a
  mapping entry or resets a typed field to the schema's default, ``~key=value`` removes
  only if the key holds that value. Hydra itself is not used: its grammar's sweeps, config
  groups and resolvers have no meaning for one typed run config, and hydra-core pins an
  older OmegaConf.

Used by the training config (``nemo_tlt.config``) and the plan config (``nemo_tlt.plan``).
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import OmegaConfBaseException


def _reraise(err: OmegaConfBaseException, source: str) -> ValueError:
    key = getattr(err, "full_key", None) or "?"
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"{source}: config key '{key}': {first}")


def build_structured(schema: type, values: dict[str, Any], prefix: str) -> Any:
    """``schema(**values)`` with nested dataclasses built first; a ValueError from a
    nested class names its key path (``ClassName.field`` -> ``prefix.field``)."""
    hints = typing.get_type_hints(schema)
    kwargs = {}
    for f in dataclasses.fields(schema):
        if f.name not in values:
            continue
        value, kind = values[f.name], hints[f.name]
        if dataclasses.is_dataclass(kind) and isinstance(value, dict):
            value = build_structured(kind, value, f"{prefix}{f.name}.")
        kwargs[f.name] = value
    try:
        return schema(**kwargs)
    except ValueError as err:
        if not prefix:
            raise
        message = str(err)
        for cls in schema.__mro__:  # a class names its own fields and those it inherits
            if dataclasses.is_dataclass(cls):
                message = message.replace(f"{cls.__name__}.", prefix)
        if message == str(err) and not message.startswith(prefix):  # names no key: say which block
            message = f"{prefix.rstrip('.')}: {message}"
        raise ValueError(message) from None


def _override_error(item: str, key: str, message: str) -> ValueError:
    return ValueError(f"override {item!r}: config key '{key}': {message}")


def parse_override(item: str) -> tuple[str, str, str | None]:
    """``(op, key, value)`` of one override: op is ``=`` (set), ``+`` (add), ``++`` (add or
    set) or ``~`` (remove; value None, or the value the key must hold)."""
    op = "++" if item.startswith("++") else item[0] if item[:1] in ("+", "~") else "="
    body = item[len(op) if op != "=" else 0:]
    key, sep, value = body.partition("=")
    if op == "~":
        return op, key.strip(), value if sep else None
    if not sep:
        hint = "; ~key removes a key" if op == "=" else ""
        raise ValueError(f"override {item!r} is not of the form {'' if op == '=' else op}key=value{hint}")
    return op, key.strip(), value


def _walk(cfg: DictConfig, key: str, item: str) -> tuple[Any, str, bool, str]:
    """The deepest existing node on ``key``'s path, the rest of the key below it, whether
    that node is a mapping field (``Dict[str, Any]``: keys may come and go) rather than a
    typed block, and the node's own key. A missing parent under a mapping field is fine
    for ``+`` (it is created)."""
    parts = key.split(".")
    if not key or not all(parts):
        raise ValueError(f"override {item!r}: malformed key {key!r}")
    node: Any = cfg
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, DictConfig) or part not in node:
            is_mapping = isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict
            return node, ".".join(parts[i:]), is_mapping, ".".join(parts[:i])
        node = node[part]
    if not isinstance(node, DictConfig):
        raise _override_error(item, key, f"'{'.'.join(parts[:-1])}' is a value, not a block")
    return node, parts[-1], OmegaConf.get_type(node) is dict, ".".join(parts[:-1])


def _apply_override(merged: DictConfig, defaults: DictConfig, item: str) -> DictConfig:
    op, key, value = parse_override(item)
    node, last, is_mapping, parent = _walk(merged, key, item)
    exists = "." not in last and last in node
    if op == "~":
        if not exists:
            raise _override_error(item, key, "cannot remove: there is no such key")
        if value is not None:
            expected = OmegaConf.from_dotlist([f"v={value}"])["v"]
            if node[last] != expected:
                raise _override_error(item, key, f"cannot remove: it holds {node[last]!r}, not {expected!r}")
        with read_write(merged), read_write(node):  # a frozen dataclass's config is read-only
            if is_mapping:  # an entry of a mapping field: dropped
                del node[last]
            else:  # a field of a typed block: back to the schema default
                OmegaConf.update(merged, key, OmegaConf.select(defaults, key), merge=False)
        return merged
    if op == "+" and exists:
        raise _override_error(item, key, f"cannot add: the key exists (holds {node[last]!r}); "
                                         f"set it with {key}={value} or use ++{key}={value}")
    if op in ("+", "++") and not exists and not is_mapping:
        where = parent or "the top level"
        raise _override_error(item, key, f"cannot add: the typed config has no key '{last.split('.')[0]}' in {where} "
                                         "(+key=value adds keys only under mapping fields such as "
                                         "task.options and task.reward_options)")
    return OmegaConf.merge(merged, OmegaConf.from_dotlist([f"{key}={value}"]))


def merge_structured(schema: type, path: str | Path | None = None, overrides: Sequence[str] = (),
                     drop: Sequence[str] = ()) -> DictConfig:
    """The merged ``defaults <- YAML file <- overrides`` of `load_structured`, before the
    values are typed and validated (a caller may read a key of it first)."""
    defaults: DictConfig = OmegaConf.structured(schema)
    merged: DictConfig = OmegaConf.structured(schema)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {p} does not exist")
        loaded = OmegaConf.load(p)
        if not isinstance(loaded, DictConfig):
            raise ValueError(f"{p}: the config must be a YAML mapping, got a {type(loaded).__name__}")
        for key in drop:
            loaded.pop(key, None)
        try:
            merged = OmegaConf.merge(merged, loaded)
        except OmegaConfBaseException as err:
            raise _reraise(err, str(p)) from None
    for item in overrides:
        try:
            merged = _apply_override(merged, defaults, item)
        except OmegaConfBaseException as err:
            raise _reraise(err, f"override {item!r}") from None
    return merged


def load_structured(schema: type, path: str | Path | None = None, overrides: Sequence[str] = (),
                    drop: Sequence[str] = ()) -> Any:
    """defaults of the dataclass ``schema`` <- YAML file <- overrides, typed and validated;
    every error is a ValueError naming the file (or the override) and the key. ``drop``:
    top-level keys of the file that are not config (read by the caller), left out.

    Overrides are read as Hydra / NeMo users type them, applied in order:
    ``key=value`` sets a key (unknown keys of a typed block are refused; under a mapping
    field such as ``task.options`` it also adds one, as before), ``+key=value`` adds a key
    that is not there (refused where it exists, and outside mapping fields, since the typed
    schema has no room for new keys), ``++key=value`` adds or sets, ``~key`` removes a key
    (a mapping entry is dropped, a typed field goes back to its schema default) and
    ``~key=value`` does so only if the key holds that value. Values are parsed as by
    OmegaConf's dotlist (YAML scalars, ``[a,b]`` lists, ``{k: v}`` mappings).

    Why not hydra-core's ``OverridesParser``: its grammar is mostly about sweeps, config
    groups and interpolation functions, none of which a single typed run config has; it
    pins ``omegaconf<2.4`` and an ANTLR runtime, which would downgrade the OmegaConf this
    project is tested with; and the four operators above are a few lines over OmegaConf.
    """
    merged = merge_structured(schema, path, overrides, drop)
    try:
        values = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as err:
        raise _reraise(err, "overrides") from None
    return build_structured(schema, values, "")
