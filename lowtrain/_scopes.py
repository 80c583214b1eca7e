"""Named scopes that lowtrain's transforms agree on (the core: no imports).

`AMP_STOP_SCOPE` marks a region that `lowtrain.amp` leaves in the precision it was
written in (`lowtrain.amp_stop` opens it). `lowtrain.fp8` opens it around its own
casts, which choose every dtype themselves; it lives here, below both, so neither
imports the other for it.
"""

AMP_STOP_SCOPE = "lowtrain.amp_stop"
