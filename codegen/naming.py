"""The one naming function: a variant's name is its C symbol prefix, its generated/ file stem, its
manifest key and the dispatcher's key."""
from __future__ import annotations

import hashlib

MAX_NAME_LENGTH = 120  # a longer name is clipped and gets a hash suffix, so it stays unique


def kernel_name(variant) -> str:
    family = variant.spec.family
    tokens = [family.name_prefix] + [family.axes[axis][value] for axis, value in variant.values]
    name = "_".join(token for token in tokens if token)  # an empty token (a default value) adds nothing
    if len(name) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[:MAX_NAME_LENGTH - 10]}_h{digest}"
    return name
