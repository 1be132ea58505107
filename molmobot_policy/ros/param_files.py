"""Which sections of a `--params-file` apply to this node, matched the way rcl matches them.

ROS applies a parameter file section only to the node it names; a section that names another
node (a typo, or a plain `molmobot_policy:` while the node runs under a namespace) is ignored
without a word, and the node would run on its defaults (random weights, no motion limits).
The node therefore refuses a parameter file none of whose sections applies to it, and warns
about a section that does not apply but names a node almost like this one (`near_miss_sections`:
a typo in a second section, whose limits would otherwise be ignored as silently).

Matching (rcl_yaml_param_parser and rclpy, checked with rclpy 9.1 / Kilted): a section name
without a leading '/' gets one ('molmobot_policy' -> '/molmobot_policy', which matches only
the node without a namespace); then it is compared with the node's fully qualified name
token by token, where '*' stands for exactly one token and '**' for any number of tokens
(zero included): '/**' matches every node, '/**/molmobot_policy' the node in any namespace,
'/robot1/*' every node directly in /robot1. Wildcards inside a token are a parse error of
rcl itself, reported by ROS before this check runs.
"""
from __future__ import annotations

import difflib
import re

import yaml


def section_pattern(section: str) -> re.Pattern:
    """The regular expression a fully qualified node name must match for `section` to apply."""
    name = section if section.startswith('/') else '/' + section
    parts = []
    for token in name.strip('/').split('/') if name.strip('/') else []:
        if token == '**':
            parts.append('(?:/[^/]+)*')
        elif token == '*':
            parts.append('/[^/]+')
        else:
            parts.append('/' + re.escape(token))
    return re.compile(''.join(parts) or '/')


def section_applies(section: str, node_fqn: str) -> bool:
    """True when ROS applies parameter file section `section` to the node `node_fqn`
    (e.g. '/robot1/molmobot_policy')."""
    return section_pattern(str(section)).fullmatch(node_fqn) is not None


def params_file_paths(argv: list[str]) -> list[str]:
    """The files named by `--params-file` in `argv` (ROS arguments), in order."""
    return [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == '--params-file']


def _parsed_files(argv: list[str]):
    """(path, {section name: its body}) for each `--params-file` in `argv` that can be read
    and parsed; the others are left to ROS to report."""
    for path in params_file_paths(argv):
        try:
            with open(path) as f:
                content = yaml.safe_load(f) or {}
            yield path, {str(k): v for k, v in content.items()}
        except (OSError, yaml.YAMLError, AttributeError):
            continue


def _node_name(section: str) -> str:
    """The last token of a section or node name ('/robot1/molmobot_policy' -> its node)."""
    return section.rstrip('/').split('/')[-1]


def unmatched_parameter_files(argv: list[str], node_fqn: str) -> list[str]:
    """One error message per `--params-file` in `argv` with no section for `node_fqn`.

    Each message names the file, its sections, the section that would apply (the node's
    fully qualified name, or '/**') and, where one is close, the likely typo. Files that
    cannot be read or parsed are left to ROS to report.
    """
    node_name = _node_name(node_fqn)
    errors = []
    for path, content in _parsed_files(argv):
        sections = list(content)
        if any(section_applies(s, node_fqn) for s in sections):
            continue
        names = [_node_name(s) for s in sections]
        close = difflib.get_close_matches(node_name, names, n=1)
        hint = ''
        if node_name in names:
            hint = f"; the node runs as '{node_fqn}': name that section '{node_fqn}:' or '/**:'"
        elif close:
            hint = f"; did you mean '{node_name}' for '{close[0]}'?"
        errors.append(f"parameter file {path} has no section for node '{node_fqn}' (its "
                      f'sections: {sections}; expected {node_fqn}:, /**/{node_name}: or '
                      f'/**:{hint}): none of '
                      'its parameters would apply')
    return errors


def near_miss_sections(argv: list[str], node_fqn: str) -> list[str]:
    """One warning per section of a `--params-file` in `argv` that does not apply to
    `node_fqn` but whose node name is close to this node's (difflib ratio >= 0.8, not equal:
    `molmobot_polcy` for `molmobot_policy`), naming the parameters it holds, which are not
    applied. Sections of other namespaces with this node's exact name are not warned about (a
    file for several robots). Files that cannot be read or parsed are left to ROS."""
    node_name = _node_name(node_fqn)
    warnings = []
    for path, content in _parsed_files(argv):
        for section, body in content.items():
            name = _node_name(section)
            if section_applies(section, node_fqn) or name == node_name or name in ('*', '**'):
                continue
            if difflib.SequenceMatcher(None, name, node_name).ratio() < 0.8:
                continue
            params = body.get('ros__parameters', {}) if isinstance(body, dict) else {}
            held = sorted(params) if isinstance(params, dict) else []
            warnings.append(f"parameter file {path}: section '{section}' does not apply to "
                            f"node '{node_fqn}' (did you mean '{node_name}'?): its parameters "
                            f'{held} are NOT applied')
    return warnings


def _ros_arguments(argv: list[str]) -> list[str]:
    """The arguments inside `--ros-args` sections of `argv` (each up to `--` or the end)."""
    out, inside = [], False
    for arg in argv:
        if arg == '--ros-args':
            inside = True
        elif arg == '--':
            inside = False
        elif inside:
            out.append(arg)
    return out


def _same_value(got, wanted) -> bool:
    """`got` (what rclpy gave) is `wanted` (the -p value as PyYAML reads it), of the same
    type; a number PyYAML leaves a string and rcl reads as one (e.g. '1e3') counts as that
    number."""
    if isinstance(wanted, (list, tuple)):
        return isinstance(got, list) and len(got) == len(wanted) and all(
            _same_value(g, w) for g, w in zip(got, wanted))
    if isinstance(got, (int, float)) and not isinstance(got, bool) and isinstance(wanted, str):
        try:
            return float(wanted) == got
        except ValueError:
            return False
    return type(got) is type(wanted) and got == wanted


def dropped_overrides(argv: list[str], node_name: str, given: dict) -> list[str]:
    """One error message per `-p [node:]name:=value` for this node in `argv` (ROS arguments)
    that did not take effect although no `--params-file` follows it: rcl keeps the value of
    an earlier parameter file's section for the same nodes (e.g. '/**') when the `-p` value
    has another type (its value then holds both, and rclpy reads the file's), without a
    word: `--params-file f.yaml -p max_image_age:=abc` runs on f.yaml's 0.5 and never says
    that 'abc' is no float. A `-p` before a `--params-file` is left alone (the later file
    overrides it, as ROS documents).

    node_name: the node's name (a `-p other_node:name:=value` is not for it). given: {name:
    the value the node was given (rclpy's parameter overrides)}; names not in it are left to
    the unknown-parameter check. Values are parsed as YAML, as rcl parses them.
    """
    args = _ros_arguments(argv)
    last_file = max((i for i, a in enumerate(args) if a == '--params-file'), default=-1)
    latest = {}
    for i, arg in enumerate(args[:-1]):
        if arg not in ('-p', '--param') or i < last_file:
            continue
        target, sep, text = args[i + 1].partition(':=')
        if not sep:
            continue
        node, _, name = target.rpartition(':')
        if node and node.strip('/').split('/')[-1] != node_name:
            continue
        latest[name] = text
    problems = []
    for name, text in latest.items():
        if name not in given:
            continue
        try:
            wanted = yaml.safe_load(text)
        except yaml.YAMLError:
            continue        # rcl refuses it itself
        value = given[name]
        got = list(value) if not isinstance(value, (str, bytes)) and hasattr(value, '__len__') \
            else value
        if not _same_value(got, wanted):
            problems.append(
                f"-p {name}:={text} did not take effect: the node was given {got!r} from a "
                f"parameter file instead (rcl keeps a file's value when a later -p gives one "
                f"of another type, here {type(wanted).__name__} for "
                f"{type(got).__name__}); give -p {name} a {type(got).__name__} value, or set "
                'it in the file')
    return problems
