"""Package discovery for the folder-to-import-name mapping declared in pyproject.toml."""

from setuptools import find_packages, setup


def mapped(import_name: str, folder: str) -> list[str]:
    return [import_name] + [f"{import_name}.{sub}" for sub in find_packages(folder)]


setup(
    packages=[
        *mapped("kvfleet", "kvfleet"),
        *mapped("kvfleet.runtime", "runtime"),
        *mapped("kvfleet.operator", "operator"),
        *mapped("kvfleet.gateway", "gateway"),
        *mapped("kvfleet.contract", "contract"),
    ]
)
