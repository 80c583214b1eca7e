"""The Hydra configs of `python -m lowtrain` (package data: `pkg://lowtrain.conf`).

This file makes `conf/` the package `lowtrain.conf`, so Hydra finds the configs in an
editable install as well as in an installed wheel.
"""
