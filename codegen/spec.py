"""Load a YAML kernel spec, validate it once at this boundary, and expand it into variants.

Spec format (documented in README.md, "Kernel specs"):

    family: dequantize            # one of codegen.families.FAMILIES
    description: free text        # optional
    axes:                         # every axis of the family, each a non-empty list of allowed values
      out_dtype: [bf16, fp16, fp32]
      arch: [sm90a, sm100a]
    exclude:                      # optional: partial assignments whose variants are skipped
      - {out_dtype: fp16, arch: sm100a}

Each rule is a named check below that raises SpecError(file, key path, reason); nvcc never validates.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from .errors import SpecError
from .families import FAMILIES, Family
from .tables import variant_facts

TOP_LEVEL_KEYS = ("family", "description", "axes", "exclude")
REQUIRED_KEYS = ("family", "axes")


@dataclass(frozen=True)
class KernelSpec:
    file: str  # path as shown in messages and generated headers (relative to the repository)
    family: Family
    description: str
    axes: tuple  # ((axis, (value, ...)), ...) in the family's axis order
    exclude: tuple  # (((axis, value), ...), ...)


@dataclass(frozen=True)
class Variant:
    spec: KernelSpec
    values: tuple  # ((axis, value), ...) in the family's axis order

    def value(self, axis: str) -> str:
        return dict(self.values)[axis]


def _allowed(values) -> str:
    return ", ".join(str(v) for v in values)


def _check_mapping(file, key_path, node):
    if not isinstance(node, dict):
        raise SpecError(file, key_path, f"must be a mapping, got {type(node).__name__} {node!r}")


def _check_keys(file, key_path, node: dict, allowed, required=()):
    for key in node:
        if key not in allowed:
            raise SpecError(file, f"{key_path}.{key}" if key_path else str(key),
                            f"unknown key {key!r}; allowed keys: {_allowed(allowed)}")
    for key in required:
        if key not in node:
            raise SpecError(file, f"{key_path}.{key}" if key_path else key, f"required key {key!r} is missing")


def _check_family(file, node) -> Family:
    name = node["family"]
    if name not in FAMILIES:
        raise SpecError(file, "family", f"{name!r} is not a kernel family; allowed: {_allowed(sorted(FAMILIES))}")
    return FAMILIES[name]


def _check_axis_value(file, key_path, family: Family, axis: str, value):
    allowed = family.axes[axis]
    if not isinstance(value, str) or value not in allowed:
        rule = getattr(allowed, "RULE", None) or _allowed(allowed)  # a rule-checked axis states its rule
        raise SpecError(file, key_path, f"{value!r} is not an allowed {axis}; allowed: {rule}")


def _check_axes(file, family: Family, node) -> tuple:
    _check_mapping(file, "axes", node)
    defaults = dict(family.defaults)
    _check_keys(file, "axes", node, family.axes, required=[axis for axis in family.axes if axis not in defaults])
    axes = []
    for axis in family.axes:  # family order: deterministic expansion and names
        values = node[axis] if axis in node else [defaults[axis]]
        if not isinstance(values, list) or not values:
            raise SpecError(file, f"axes.{axis}", f"must be a non-empty list of values, got {values!r}")
        for i, value in enumerate(values):
            _check_axis_value(file, f"axes.{axis}[{i}]", family, axis, value)
        duplicates = sorted({v for v in values if values.count(v) > 1})
        if duplicates:
            raise SpecError(file, f"axes.{axis}", f"lists {_allowed(duplicates)} more than once")
        axes.append((axis, tuple(values)))
    return tuple(axes)


def _check_exclude(file, family: Family, node) -> tuple:
    if not isinstance(node, list):
        raise SpecError(file, "exclude", f"must be a list of partial assignments, got {node!r}")
    rules = []
    for i, rule in enumerate(node):
        _check_mapping(file, f"exclude[{i}]", rule)
        _check_keys(file, f"exclude[{i}]", rule, family.axes)
        for axis, value in rule.items():
            _check_axis_value(file, f"exclude[{i}].{axis}", family, axis, value)
        rules.append(tuple(sorted(rule.items())))
    return tuple(rules)


def load_spec(path: Path, shown_as: str | None = None) -> KernelSpec:
    """Parse and validate one spec file; `shown_as` is the path used in messages and headers."""
    file = shown_as or str(path)
    raw = Path(path).read_bytes()
    try:
        node = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise SpecError(file, "", f"is not valid YAML: {exc}") from None
    _check_mapping(file, "", node)
    _check_keys(file, "", node, TOP_LEVEL_KEYS, REQUIRED_KEYS)
    family = _check_family(file, node)
    description = node.get("description", family.description)
    if not isinstance(description, str):
        raise SpecError(file, "description", f"must be a string, got {description!r}")
    axes = _check_axes(file, family, node["axes"])
    exclude = _check_exclude(file, family, node.get("exclude", []))
    spec = KernelSpec(file, family, description, axes, exclude)
    if not expand(spec):
        family_rules = "; ".join(why for _, why in family.excluded)
        raise SpecError(file, "axes", "every combination of axes is excluded, so the spec declares no kernel"
                        + (f" (not buildable: {family_rules})" if family_rules else ""))
    return spec


def expand(spec: KernelSpec) -> list:
    """All variants of a spec: the product of its axes, in order, minus the assignments the spec excludes
    and those its family can never build (family.excluded, e.g. row scaling with 16x16 blocks)."""
    names = [axis for axis, _ in spec.axes]
    variants = []
    for combo in itertools.product(*(values for _, values in spec.axes)):
        values = tuple(zip(names, combo))
        if any(set(rule) <= set(values) for rule in spec.exclude):
            continue
        named = dict(values)
        if any(drop(named, variant_facts(named)) for drop, _ in spec.family.excluded):
            continue
        variants.append(Variant(spec, values))
    return variants
