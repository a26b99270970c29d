import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["shadowkv_core", "kernels", "serve_app", "training"])
def test_package_imports_with_docstring(name):
    module = importlib.import_module(name)
    assert module.__doc__ and "May import" in module.__doc__


def test_transformers_does_not_mistake_our_kernels_package_for_hf_kernels():
    # Run in a fresh interpreter: is_kernels_available is cached and other tests may have imported transformers.
    code = (
        "import importlib.util, kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert importlib.util.find_spec('kernels') is not None\n"
        "print(is_kernels_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_never_imports_ray_or_serve_app():
    code = (
        "import sys, shadowkv_core, kernels\n"
        "import pkgutil, importlib\n"
        "for m in pkgutil.walk_packages(shadowkv_core.__path__, 'shadowkv_core.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n == 'ray' or n.startswith(('ray.', 'serve_app')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
