"""The test tolerances, read from tests/tolerance.h (the one table the C tests
use too), so a bound is changed in one place. What they mean: docs/numerics.md.

    import tolerance
    tolerance.REL_L2["bf16"]   # an item's output against the reference
    tolerance.PREFIX_HIT       # a prefix hit against the same steps cold
"""
import os
import re

_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tolerance.h")


def _read():
    with open(_HEADER) as f:
        text = f.read()
    vals = {m.group(1): float(m.group(2))
            for m in re.finditer(r"^#define ATTND_TOL_(\w+) ([0-9.eE+-]+)\s*$", text, re.MULTILINE)}
    if not vals:
        raise RuntimeError(f"no ATTND_TOL_ numbers in {_HEADER}")
    return vals


_T = _read()
# By cache type, named as --kv-cache names them.
REL_L2 = {name: _T[name.upper()] for name in
          ("bf16", "fp16", "int8", "fp8", "int8_dynamic", "fp8_dynamic", "int4")}
PREFIX_HIT = _T["PREFIX_HIT"]
STATIC_SCALES_E2E = _T["STATIC_SCALES_E2E"]
ENGINE_LSE = _T["ENGINE_LSE"]  # |got - ref| <= ENGINE_LSE * (1 + |ref|)
