"""ROS 2 topic-name resolution without a node: a relative name plus a namespace and ``from:=to`` remap rules -> the
fully qualified topic name, as rcl resolves it for ``oxygen_node``.

This file owns one rule, so that the offline tools find the topics the node would use: ``oxygen bag-eval`` maps the
node's relative input names (``camera/base/image_raw``, ``joint_states``, ``instruction``, ``conversation/prompt``)
to the recorded bag topics, and ``bag-eval`` / ``oxygen replay --record`` name the output topics (``action_chunk``,
``language/tokens``, ...) exactly as the node publishes them.  Rules, as in rcl: a name is expanded against the
namespace (``camera/x`` in ``/robot1`` -> ``/robot1/camera/x``; absolute names stay); each remap rule's ``from`` is
expanded the same way and the first rule whose expansion equals the name's replaces it by its expanded ``to``.
``__ns:=/robot1`` sets the namespace; ``node_name:from:=to`` applies only to that node.  Private (``~``) names and
substitutions (``{node}``) are not supported (the node uses neither).  No rclpy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["TopicNames", "expand"]


def expand(name: str, namespace: str = "/") -> str:
    """Fully qualified name of ``name`` in ``namespace`` (absolute names are returned unchanged)."""
    name = name.strip()
    if not name:
        raise ValueError("empty topic name")
    if name.startswith("~") or "{" in name:
        raise ValueError(f"topic name {name!r}: private names and substitutions are not supported here")
    if name.startswith("/"):
        return name
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    return f"{ns}/{name}"


@dataclass
class TopicNames:
    """``TopicNames(namespace="/", remaps=["camera/base/image_raw:=/cam0/image", "__ns:=/robot1"])``."""
    namespace: str = "/"
    remaps: list = field(default_factory=list)       # "from:=to" strings, as given to --ros-args -r
    node_name: str = "oxygen_node"

    def __post_init__(self):
        self._rules: list[tuple[str, str]] = []
        for rule in self.remaps:
            if ":=" not in rule:
                raise ValueError(f"remap {rule!r} is not from:=to")
            src, dst = (x.strip() for x in rule.split(":=", 1))
            if src.count(":") == 1 and not src.startswith("/"):      # node_name:from:=to
                node, src = src.split(":", 1)
                if node != self.node_name:
                    continue
            if src == "__ns":
                self.namespace = dst
            else:
                self._rules.append((src, dst))
        self.namespace = "/" + self.namespace.strip("/")

    def resolve(self, name: str) -> str:
        full = expand(name, self.namespace)
        for src, dst in self._rules:
            if expand(src, self.namespace) == full:
                return expand(dst, self.namespace)
        return full
