"""Which packages the distribution holds; everything else is in pyproject.toml.

`recipes/` and `conf/` ship inside the package as `lowtrain.recipes` and
`lowtrain.conf` (no top-level import names of their own), with the YAML files as
package data, so Hydra finds `pkg://lowtrain.conf` from an installed wheel and from an
editable install alike (and `lowtrain/_checkout.py` finds them in a checkout). This is
a setup.py because pyproject.toml can either list the packages or find them, not both:
lowtrain's own subpackages are found, the mapped ones are added. The config groups
(`conf/recipe/`, ...) are listed as packages too: setuptools deprecates shipping data
folders that are not.
"""

from setuptools import find_namespace_packages, find_packages, setup

CONF_GROUPS = [
    f"lowtrain.conf.{name}"
    for name in find_namespace_packages(where="conf", exclude=["*__pycache__*"])
]

setup(
    packages=[
        *find_packages(include=["lowtrain", "lowtrain.*"]),
        "lowtrain.recipes",
        "lowtrain.conf",
        *CONF_GROUPS,
    ],
    package_dir={"lowtrain.recipes": "recipes", "lowtrain.conf": "conf"},
    package_data={name: ["*.yaml"] for name in ("lowtrain.conf", *CONF_GROUPS)},
)
