"""Which folders become which kvpilot packages. pyproject.toml holds the rest of the metadata.

The repository has no kvpilot/ folder: each top-level folder is mapped onto the `kvpilot`
namespace. setuptools' declarative `packages.find` names what it finds after the folders
(`runtime.core`, not `kvpilot.runtime.core`), so the prefix is added here. Folders without an
`__init__.py` (operator/, on purpose) are found as namespace packages.
"""

from setuptools import find_namespace_packages, setup

PACKAGE_DIR = {"kvpilot.runtime": "runtime", "kvpilot.kernels": "kernels", "kvpilot.operator": "operator"}

setup(
    package_dir=PACKAGE_DIR,
    packages=[
        f"{package}.{found}" if found else package
        for package, folder in PACKAGE_DIR.items()
        for found in ["", *find_namespace_packages(where=folder, exclude=["__pycache__", "*.__pycache__"])]
    ],
    # The C kernels are compiled from source on first use (kernels/cpu/build.py).
    package_data={"kvpilot.kernels.cpu": ["*.c"]},
)
