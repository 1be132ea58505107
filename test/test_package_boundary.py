"""The policy package (molmobot_policy/) stands alone: no module of it imports the demo package
(molmobot_policy_demo, in demo/) or names one of its modules for a subprocess, so a robot that
builds and installs only the policy package runs all of it (docs/decisions/demo-package.md)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = 'molmobot_policy_demo'


def _demo_references(path: Path) -> list[str]:
    """`line: what` for each import of the demo package in `path`, and each string literal
    naming one of its modules (importlib.import_module, `python -m`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ''] if node.level == 0 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [word for word in node.value.split() if word.startswith(DEMO)]
        else:
            continue
        found += [f'{node.lineno}: {name}' for name in names
                  if name == DEMO or name.startswith(DEMO + '.')]
    return found


def test_no_module_of_the_policy_package_imports_the_demo_package():
    modules = sorted((REPO / 'molmobot_policy').rglob('*.py'))
    assert len(modules) > 20        # the package's modules were found
    found = {str(path.relative_to(REPO)): refs for path in modules
             if (refs := _demo_references(path))}
    assert not found, f'the policy package must not use {DEMO}: {found}'


def test_the_check_finds_an_import_and_a_module_name(tmp_path):
    module = tmp_path / 'm.py'
    module.write_text('import os\nfrom molmobot_policy_demo.sim import plots\n'
                      "ARGV = ['-m', 'molmobot_policy_demo.demo']\n"
                      "TEXT = 'molmobot_policy_demonstration is not it'\n")
    assert _demo_references(module) == ['2: molmobot_policy_demo.sim',
                                        '3: molmobot_policy_demo.demo']
