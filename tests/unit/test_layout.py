"""The rules that make the folder tree the architecture, checked on the source: the batching core is
pure, and the service never imports the tools built on it."""

from __future__ import annotations

import ast
from pathlib import Path

import carpool

PACKAGE = Path(carpool.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def sources(under: str = "") -> list[Path]:
    return sorted((PACKAGE / under).rglob("*.py"))


def test_the_batching_core_imports_nothing_of_redis_celery_kombu_or_torch() -> None:
    allowed_carpool = ("carpool.batching", "carpool.names")
    for path in sources("batching"):
        for module in imported_modules(path):
            top = module.split(".")[0]
            assert top not in {"redis", "celery", "kombu", "torch", "numpy"}, f"{path.name} imports {module}"
            if top == "carpool":
                assert module.startswith(allowed_carpool), f"{path.name} imports {module}"


def test_the_service_never_imports_the_tools() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)} imports {module}"
        for path in sources()
        if "tools" not in path.relative_to(PACKAGE).parts and path.name != "cli.py"
        for module in imported_modules(path)
        if module.startswith("carpool.tools")
    ]
    assert offenders == []


def test_the_rule_checker_sees_imports_inside_functions() -> None:
    assert "carpool.tools.demo" in imported_modules(PACKAGE / "cli.py")
