"""hybridrl/algos is pure math: it may import only torch, numpy, the standard library and itself."""

import ast
import sys
from pathlib import Path

import hybridrl.algos

ALLOWED_ROOTS = {"torch", "numpy", "__future__"} | set(sys.stdlib_module_names)


def imported_modules(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, ("." * node.level) + (node.module or "")


def test_algos_imports_only_torch_numpy_stdlib_and_itself():
    files = sorted(Path(hybridrl.algos.__file__).parent.glob("*.py"))
    assert len(files) >= 8
    offenders = []
    for path in files:
        for lineno, module in imported_modules(path):
            if module.startswith("."):
                continue  # relative import inside hybridrl.algos
            if module.split(".")[0] in ALLOWED_ROOTS:
                continue
            if module == "hybridrl.algos" or module.startswith("hybridrl.algos."):
                continue
            offenders.append(f"{path.name}:{lineno} imports {module}")
    assert not offenders, "hybridrl/algos must stay pure torch/numpy:\n" + "\n".join(offenders)
