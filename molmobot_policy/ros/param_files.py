"""Which sections of a `--params-file` apply to this node, matched the way rcl matches them.

ROS applies a parameter file section only to the node it names; a section that names another
node (a typo, or a plain `molmobot_policy:` while the node runs under a namespace) is ignored
without a word, and the node would run on its defaults (random weights, no motion limits).
The node therefore refuses a parameter file none of whose sections applies to it.

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


def unmatched_parameter_files(argv: list[str], node_fqn: str) -> list[str]:
    """One error message per `--params-file` in `argv` with no section for `node_fqn`.

    Each message names the file, its sections, the section that would apply (the node's
    fully qualified name, or '/**') and, where one is close, the likely typo. Files that
    cannot be read or parsed are left to ROS to report.
    """
    node_name = node_fqn.rstrip('/').split('/')[-1]
    errors = []
    for path in params_file_paths(argv):
        try:
            with open(path) as f:
                sections = [str(k) for k in (yaml.safe_load(f) or {}).keys()]
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if any(section_applies(s, node_fqn) for s in sections):
            continue
        names = [s.rstrip('/').split('/')[-1] for s in sections]
        close = difflib.get_close_matches(node_name, names, n=1)
        hint = ''
        if node_name in names:
            hint = f"; the node runs as '{node_fqn}': name that section '{node_fqn}:' or '/**:'"
        elif close:
            hint = f"; did you mean '{node_name}' for '{close[0]}'?"
        errors.append(f"parameter file {path} has no section for node '{node_fqn}' (its "
                      f'sections: {sections}; expected {node_fqn}: or /**:{hint}): none of '
                      'its parameters would apply')
    return errors
