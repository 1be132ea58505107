"""docs/PARAMETERS.md, rendered from the node's declared parameters (`parameters.PARAMETERS`):
one row per parameter with its type, default, whether it may change at run time, and its
description with the allowed values or range, as `ros2 param describe` shows them.

    python -m molmobot_policy.ros.parameter_docs > docs/PARAMETERS.md     # regenerate
    python -m molmobot_policy.ros.parameter_docs --check docs/PARAMETERS.md

test/test_parameter_docs.py fails when the file and the declarations differ.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rcl_interfaces.msg import ParameterDescriptor, ParameterType

from molmobot_policy.ros.parameters import PARAMETERS, START_ONLY

COMMAND = 'python -m molmobot_policy.ros.parameter_docs > docs/PARAMETERS.md'
TYPE_NAMES = {ParameterType.PARAMETER_BOOL: 'bool', ParameterType.PARAMETER_INTEGER: 'integer',
              ParameterType.PARAMETER_DOUBLE: 'double', ParameterType.PARAMETER_STRING: 'string',
              ParameterType.PARAMETER_INTEGER_ARRAY: 'integer[]',
              ParameterType.PARAMETER_DOUBLE_ARRAY: 'double[]',
              ParameterType.PARAMETER_STRING_ARRAY: 'string[]'}
HEADER = f"""# molmobot_policy node parameters

<!-- Generated from molmobot_policy/ros/parameters.py (PARAMETERS); do not edit by hand.
     Regenerate: {COMMAND} -->

Every parameter the node declares, in declaration order. Set them in a `--params-file`
(`config/policy_droid.yaml` is a complete example) or with `-p name:=value`; an unknown name
fails configure with a suggestion. *run time*: `yes`: `ros2 param set` (with the PyPI wheels
only, which have no `ros2 param`: the SetParameters call of docs/ROBOT.md) changes it while the
node runs; `unconfigured`: read at configure / activate, so a set is taken only while the node
is unconfigured (deactivate, cleanup, set, configure, activate); `no`: read at start only.
Write doubles with a decimal point (`1.0`, not `1`) in parameter files and on the command
line (a file's `1`, or `-p chunk_period:=1`, is refused with that hint); `ros2 param set` takes
`1` for a double as `1.0`. *dynamic*: the node converts the value at configure, so a per-joint list
also takes one number, and `fused_action_expert` also takes unquoted `on` / `off` (which
YAML reads as booleans).
On a full ROS 2 install `ros2 param describe /molmobot_policy <name>` shows the same
descriptions.

| parameter | type | default | run time | meaning; allowed values |
|---|---|---|---|---|
"""


def _yaml_value(value) -> str:
    """A default as it is written in a parameter file."""
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, (list, tuple)):
        return '[' + ', '.join(_yaml_value(v) for v in value) + ']'
    if isinstance(value, str):
        return value if value and value.strip() == value and ':' not in value else repr(value)
    return repr(value)


def _limits(descriptor: ParameterDescriptor) -> str:
    """The descriptor's range and additional constraints as one phrase ('' when none)."""
    parts = []
    for ranges in (descriptor.floating_point_range, descriptor.integer_range):
        if ranges:
            parts.append(f'range {ranges[0].from_value:.10g} to {ranges[0].to_value:.10g}')
    if descriptor.additional_constraints:
        parts.append(descriptor.additional_constraints)
    return '; '.join(parts)


def _cell(text: str) -> str:
    return text.replace('|', '\\|').replace('\n', ' ')


def _when(name: str, descriptor: ParameterDescriptor) -> str:
    """The *run time* column: yes / unconfigured / no (`parameters.START_ONLY`, read_only;
    the node refuses the read_only ones while configured: `PolicyNode._not_settable`)."""
    return 'no' if name in START_ONLY else 'unconfigured' if descriptor.read_only else 'yes'


def table_row(name: str, default, descriptor: ParameterDescriptor) -> str:
    """One markdown table row for the parameter `name`."""
    meaning = descriptor.description
    if _limits(descriptor):
        meaning += f'; {_limits(descriptor)}'
    type_name = TYPE_NAMES.get(descriptor.type, str(descriptor.type))
    if descriptor.dynamic_typing:
        type_name += ' (dynamic)'
    return (f'| `{name}` | {type_name} | `{_cell(_yaml_value(default))}` | '
            f"{_when(name, descriptor)} | {_cell(meaning)} |")


def render(parameters: dict = PARAMETERS) -> str:
    """docs/PARAMETERS.md for `parameters` ({name: (default, ParameterDescriptor)})."""
    return HEADER + ''.join(table_row(name, default, descriptor) + '\n'
                            for name, (default, descriptor) in parameters.items())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', type=Path, default=None,
                        help='compare with this file instead of printing; exit 1 if it differs')
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    if not args.check.is_file() or args.check.read_text() != text:
        print(f'{args.check} is not what molmobot_policy/ros/parameters.py declares; '
              f'regenerate it: {COMMAND}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
