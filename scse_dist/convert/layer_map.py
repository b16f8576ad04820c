"""A retrofit's layer map: which layers of an untied stack become prelude, core and coda.

Layers are numbered 0..L-1 over the whole untied stack (prelude, its core groups, coda). A range
is `A-B` (inclusive), `A` (one layer) or `none` (empty; not for the core). The three run in layer
order without overlapping; layers between or around them are left out. A bad map is a ConfigError
naming the flag (exit 2), raised before anything is read beyond the config or written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scse_dist.typed_yaml import ConfigError

# The map of McLeish et al. (2025) for TinyLlama's 22 layers, as fractions of the stack:
# prelude 0-3, core 10-17, coda 18-21 (layers 4-9 left out). default_map scales it to L layers.
_DEFAULT_SHARES = (4 / 22, 8 / 22, 4 / 22)
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


@dataclass(frozen=True)
class LayerMap:
    n_layers: int
    prelude: range
    core: range
    coda: range

    @property
    def kept(self) -> list[int]:
        return [*self.prelude, *self.core, *self.coda]

    @property
    def left_out(self) -> list[int]:
        kept = set(self.kept)
        return [i for i in range(self.n_layers) if i not in kept]

    def describe(self) -> str:
        return (f"prelude {span(self.prelude)}, core {span(self.core)} (looped as one block), "
                f"coda {span(self.coda)}")

    def record(self) -> dict[str, list[int]]:
        """The map as layer lists (retrofit.json)."""
        return {"prelude": list(self.prelude), "core": list(self.core), "coda": list(self.coda),
                "left_out": self.left_out}


def span(r: range) -> str:
    """The flag syntax of a range: `A-B`, `A`, or `none`."""
    if not r:
        return "none"
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def parse_range(flag: str, text: str, n_layers: int) -> range:
    """`A-B`, `A` or `none` as a range of layers 0..n_layers-1 (ConfigError naming `flag`)."""
    text = text.strip()
    if text.lower() == "none":
        return range(0)
    match = _RANGE.fullmatch(text)
    if not match:
        raise ConfigError(f"{flag}: expected a layer range A-B, one layer A, or none; got {text!r}")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        raise ConfigError(f"{flag} {text}: the range runs backwards; write the lower layer first "
                          f"({last}-{first})")
    if last >= n_layers:
        raise ConfigError(f"{flag} {text}: layer {last} is past the last layer (the export has "
                          f"{n_layers} layers, 0-{n_layers - 1})")
    return range(first, last + 1)


def layer_map(n_layers: int, prelude: str, core: str, coda: str) -> LayerMap:
    """The map the three flags give, checked: in range, in order, not overlapping, a core."""
    parts = {"--prelude": parse_range("--prelude", prelude, n_layers),
             "--core": parse_range("--core", core, n_layers),
             "--coda": parse_range("--coda", coda, n_layers)}
    if not parts["--core"]:
        raise ConfigError("--core: the core needs at least one layer (the loop runs it); got none")
    named = [(flag, r) for flag, r in parts.items() if r]
    for (flag_a, a), (flag_b, b) in zip(named, named[1:]):
        shared = sorted(set(a) & set(b))
        if shared:
            raise ConfigError(f"{flag_a} {span(a)} and {flag_b} {span(b)} overlap at layer "
                              f"{shared[0]}; each layer goes to one part at most")
        if b.start < a.start:
            raise ConfigError(f"{flag_b} {span(b)} comes before {flag_a} {span(a)}; the map runs "
                              "prelude, core, coda in layer order")
    return LayerMap(n_layers, parts["--prelude"], parts["--core"], parts["--coda"])


def default_map(n_layers: int) -> LayerMap:
    """McLeish et al.'s TinyLlama map scaled to `n_layers`: the first ~4/22 of the layers as the
    prelude, the last ~4/22 as the coda, the ~8/22 just before the coda as the core, and the
    layers between prelude and core left out (at least one layer each where the stack allows)."""
    if n_layers < 1:
        raise ConfigError(f"the export has no layers to retrofit (n_layers={n_layers})")
    p, c, k = (max(1, round(n_layers * share)) for share in _DEFAULT_SHARES)
    while p + c + k > n_layers:  # a very short stack: shrink prelude and coda first, keep a core
        if k >= p and k > 0:
            k -= 1
        elif p > 0:
            p -= 1
        else:
            c -= 1
    return LayerMap(n_layers, range(p), range(n_layers - k - c, n_layers - k),
                    range(n_layers - k, n_layers))
