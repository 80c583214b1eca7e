"""The numerics internals `scripts/` times (the compiled program behind
`lowtrain.numerics.track`), named in one place. Not public API."""

from ._track import tracked_call as tracked_call
