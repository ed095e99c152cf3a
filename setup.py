"""Maps each top-level folder into the one import namespace ``radixlm`` (radixlm.srt, ...)."""

from setuptools import find_packages, setup

TOP_LEVEL = ["srt", "lang", "radix", "grammar", "hicache", "kernels"]

packages: list[str] = []
package_dir: dict[str, str] = {}
for top in TOP_LEVEL:
    packages.append(f"radixlm.{top}")
    package_dir[f"radixlm.{top}"] = top
    packages += [f"radixlm.{top}.{sub}" for sub in find_packages(top)]

setup(packages=packages, package_dir=package_dir, include_package_data=True)
