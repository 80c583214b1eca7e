"""Which packages the distribution holds; everything else is in pyproject.toml.

`recipes/` and `conf/` ship inside the package as `lowtrain.recipes` and
`lowtrain.conf` (no top-level import names of their own), with the YAML files as
package data, so Hydra finds `pkg://lowtrain.conf` from an installed wheel and from an
editable install alike. This is a setup.py because pyproject.toml can either list the
packages or find them, not both: lowtrain's own subpackages are found, the two
mapped ones are added.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["lowtrain", "lowtrain.*"]),
        "lowtrain.recipes",
        "lowtrain.conf",
    ],
    package_dir={"lowtrain.recipes": "recipes", "lowtrain.conf": "conf"},
    package_data={"lowtrain.conf": ["*.yaml", "*/*.yaml"]},
)
