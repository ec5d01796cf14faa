"""Only ``_compat.py`` reaches the private parts of the libraries the package builds on.

Read from the source, as the import test reads imports: an import from a private module (``from torchft._torchft
import ...``), an import of a private name (``from torch.nn.modules.batchnorm import _BatchNorm``), or a private
attribute reached through a module (``torch.cuda._sleep``, ``rpc._init_counter`` after ``from torch.distributed
import rpc``). A private attribute of an object (``model._has_rebuilt_buckets``) cannot be told from the source;
``_compat`` holds those too, by the project's rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dynamix"
LIBRARIES = {"torch", "lightning", "pytorch_lightning", "accelerate", "torchmetrics", "stable_baselines3", "torchft"}
ALLOWED = {PACKAGE / "_compat.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _library(dotted: str) -> bool:
    return dotted.split(".")[0] in LIBRARIES


def private_uses(source: str) -> list[str]:
    """Where ``source`` reaches a private part of one of :data:`LIBRARIES`, as ``line: what``."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # a local name bound to a library's module -> its dotted path
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _library(alias.name):
                    continue
                if any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{node.lineno}: import {alias.name}")
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    modules[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and _library(node.module or ""):
            module = node.module or ""
            for alias in node.names:
                if any(_private(part) for part in module.split(".")) or _private(alias.name):
                    found.append(f"{node.lineno}: from {module} import {alias.name}")
                modules[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, base = [node.attr], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in modules and any(_private(part) for part in chain):
            found.append(f"{node.lineno}: {modules[base.id]}.{'.'.join(reversed(chain))}")
    return sorted(set(found), key=lambda row: int(row.split(":")[0]))


def test_no_module_but_compat_reaches_a_private_part_of_a_library():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path not in ALLOWED:
            offenders += [f"{path.relative_to(PACKAGE.parent)}:{use}" for use in private_uses(path.read_text())]
    assert not offenders, "reach these through lightning_dynamix/_compat.py:\n" + "\n".join(offenders)


def test_the_scan_sees_private_modules_names_and_attributes_through_any_alias():
    source = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "from torch.distributed import rpc",
            "from torchft._torchft import LighthouseServer",
            "from torch.nn.modules.batchnorm import _BatchNorm",
            "import lightning.pytorch._graveyard",
            "def f(model):",
            "    torch.cuda._sleep(5)",
            "    rpc._init_counter = 0",
            "    dist.distributed_c10d._world",
            "    model._has_rebuilt_buckets",  # an object's attribute: not a module path
            "    torch.cuda.synchronize()",
            "    torch.Tensor.__add__",
        ]
    )
    assert private_uses(source) == [
        "4: from torchft._torchft import LighthouseServer",
        "5: from torch.nn.modules.batchnorm import _BatchNorm",
        "6: import lightning.pytorch._graveyard",
        "8: torch.cuda._sleep",
        "9: torch.distributed.rpc._init_counter",
        "10: torch.distributed.distributed_c10d._world",
    ]
