"""The README and docs/PARAMETERS.md say what the code does today: the parameter reference is
the node's declarations rendered, the README's tables name only declared parameters and quote
only messages the code still produces, and the JointTrajectoryController example wires the
node's output to the controller's joints and topic."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip('rclpy')
from molmobot_policy.ros import parameter_docs  # noqa: E402
from molmobot_policy.ros.parameters import PARAMETERS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README = (REPO / 'README.md').read_text()
JTC_EXAMPLE = REPO / 'config' / 'joint_trajectory_controller_example.yaml'


def _section(heading: str) -> str:
    """The README text under `heading` up to the next heading of any level."""
    start = README.index(heading + '\n') + len(heading) + 1
    end = re.search(r'^#{2,3} ', README[start:], re.MULTILINE)
    return README[start:start + end.start()] if end else README[start:]


def _first_column_spans(section: str) -> list[str]:
    """The `code` spans in the first column of the section's table (header row excluded)."""
    rows = [line for line in section.splitlines() if line.startswith('| ')][1:]
    return [span for row in rows for span in re.findall(r'`([^`]+)`',
                                                        re.split(r'(?<!\\)\|', row)[1])]


def _string_literals() -> list[str]:
    """Every string literal of molmobot_policy/, f-strings with each placeholder as '\\0'
    (adjacent literals are one: Python joins them when parsing)."""
    texts = []
    for path in (REPO / 'molmobot_policy').rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                texts.append(''.join(v.value if isinstance(v, ast.Constant) else '\0'
                                     for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return texts


def test_the_parameter_reference_is_the_declared_parameters_rendered():
    written = (REPO / 'docs' / 'PARAMETERS.md').read_text()
    assert written == parameter_docs.render(), (
        f'docs/PARAMETERS.md differs from molmobot_policy/ros/parameters.py; regenerate it: '
        f'{parameter_docs.COMMAND}')


def test_the_reference_has_one_row_per_parameter_with_default_and_range():
    rows = [line for line in parameter_docs.render().splitlines() if line.startswith('| `')]
    assert [re.match(r'\| `([^`]+)`', row).group(1) for row in rows] == list(PARAMETERS)
    control_period = next(row for row in rows if row.startswith('| `control_period`'))
    assert control_period == ('| `control_period` | double | `0.1` | unconfigured | seconds '
                              'between consecutive actions of a chunk; range 0.001 to 10 |')
    autostart = next(row for row in rows if row.startswith('| `autostart`'))
    assert '| bool | `true` | no |' in autostart        # read at start only
    instruction = next(row for row in rows if row.startswith('| `instruction`'))
    assert "| string | `''` | yes |" in instruction        # may change at run time


def test_a_stale_reference_fails_the_check_naming_the_command(tmp_path):
    stale = tmp_path / 'PARAMETERS.md'
    stale.write_text(parameter_docs.render().replace('| `seed` |', '| `sead` |'))
    done = subprocess.run([sys.executable, '-m', 'molmobot_policy.ros.parameter_docs',
                           '--check', str(stale)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and parameter_docs.COMMAND in done.stderr, done.stderr
    stale.write_text(parameter_docs.render())
    assert subprocess.run([sys.executable, '-m', 'molmobot_policy.ros.parameter_docs',
                           '--check', str(stale)], cwd=REPO, timeout=120).returncode == 0


def test_the_readme_parameter_table_names_only_declared_parameters():
    names = _first_column_spans(_section('## Parameters'))
    assert len(names) > 20
    assert [n for n in names if n not in PARAMETERS] == []
    assert '(docs/PARAMETERS.md)' in _section('## Parameters')


def test_every_message_the_troubleshooting_table_quotes_is_in_the_code():
    literals = _string_literals()
    spans = _first_column_spans(_section('## Troubleshooting'))
    assert len(spans) > 20
    missing = []
    for span in spans + ['configure failed: …', 'skipping tick …: …']:
        pattern = re.compile('.*?'.join(re.escape(piece) for piece in span.split('…')),
                             re.DOTALL)
        if not any(pattern.search(text) for text in literals):
            missing.append(span)
    assert missing == [], f'README troubleshooting quotes messages no code produces: {missing}'


def test_the_controller_example_takes_the_nodes_joints_on_its_topic():
    example = yaml.safe_load(JTC_EXAMPLE.read_text())
    droid = yaml.safe_load((REPO / 'config' / 'policy_droid.yaml').read_text())
    managed = example['controller_manager']['ros__parameters']
    [controller] = [name for name, value in managed.items() if isinstance(value, dict)
                    and value.get('type') == 'joint_trajectory_controller/'
                                             'JointTrajectoryController']
    jtc = example[controller]['ros__parameters']
    section = '/**/molmobot_policy'      # the packaged files' section: any namespace
    node = example[section]['ros__parameters']
    assert jtc['joints'] == droid[section]['ros__parameters']['action_joint_names']
    assert node['output_topic'] == f'/{controller}/joint_trajectory'   # the JTC's ~/ topic
    assert set(node) <= set(PARAMETERS)      # the node takes this file as a --params-file
    assert jtc['interpolation_method'] in ('splines', 'none')
    assert jtc['command_interfaces'] == ['position']
    assert jtc['state_interfaces'][0] == 'position'
    assert f'remap `-r /molmobot_policy/joint_trajectory:=/{controller}/joint_trajectory`' in \
        README


def test_no_tracked_text_file_holds_merge_conflict_markers():
    """A merge left `<<<<<<<` / `=======` / `>>>>>>>` lines in the README once; no test read
    that section, so it shipped. Every tracked text file is checked."""
    files = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:
        pytest.skip('not a git checkout')
    marker = re.compile(r'^(<{7} |={7}$|>{7} )', re.MULTILINE)
    found = []
    for name in files:
        path = REPO / name
        if path.suffix not in {'.md', '.py', '.yaml', '.yml', '.xml', '.txt', '.sh', '.cfg',
                               '.toml', ''} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f'{name}:{text.count(chr(10), 0, m.start()) + 1}' for m in marker.finditer(text)]
    assert not found, f'merge-conflict markers at {found}'


def test_robot_md_explains_every_chunk_info_key():
    from molmobot_policy.ros.messages import ChunkInfo
    robot = (REPO / 'docs' / 'ROBOT.md').read_text()
    start = robot.index('## What each chunk reports')
    section = robot[start:robot.index('\n## ', start + 1)]
    keys = [v for k, v in vars(ChunkInfo).items() if k.isupper() and isinstance(v, str)]
    missing = [key for key in keys if f'`{key}`' not in section]
    assert keys and not missing, f'ROBOT.md "What each chunk reports" lacks {missing}'


def test_the_model_parameter_describes_each_preset_as_it_is():
    """The `model` description gives each preset's cameras, state / action size and horizon
    (second trial of 2026-12-07: the tiny preset's were written nowhere)."""
    from molmobot_policy.model.config import PRESETS, MolmoBotConfig
    from molmobot_policy.ros.parameters import PARAMETERS
    text = PARAMETERS['model'][1].description
    for name in PRESETS:
        c = MolmoBotConfig.from_name(name)
        match = re.search(re.escape(name) + r' \((?:[^;)]*; )?(?:up to )?(\d+) cameras?, '
                          r'(?:state and actions )?(\d+)-D, (?:horizon )?(\d+)\)', text)
        assert match, (name, text)
        assert tuple(int(g) for g in match.groups()) == (c.max_images, c.action_dim,
                                                        c.action_horizon), (name, text)
        assert c.state_dim == c.action_dim, name      # the text gives one size for both
