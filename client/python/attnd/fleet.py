"""The daemons a client fans out to: a config file format and the attnd@N scheme.

A fleet file is TOML (or JSON with the same structure), read with the standard
library (tomllib, json). docs/scale-out.md describes it; in short:

    [defaults]                       # optional; applies to every daemon
    timeout = 30                     # seconds per call
    token_file = "/etc/attnd/token"  # sent in Hello (needed on TCP off loopback)

    [local]                          # optional: attnd@0 .. attnd@N-1 on this host
    instances = 2                    # sockets /run/attnd/N/attnd.sock

    [[daemon]]                       # any number, in order
    name = "gpu0"                    # unique; defaults to the address
    address = "/run/attnd/0/attnd.sock"   # or "HOST:PORT"
    kv_heads = "0:4"                 # optional: the kv heads it holds (head sharding)
    group = "shardA"                 # optional: the head-sharded or split group it belongs to
    weight = 1                       # optional: its share of the placement ring

Daemons of one group together form one model (head sharding) or one long
context (split context); placement puts each session on one group, or on one
daemon when there are no groups.
"""

import dataclasses
import json
import os
from typing import List, Optional, Tuple

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover - Debian 12 has 3.11
    tomllib = None

# The attnd@N scheme of one host with several GPUs (docs/scale-out.md): the unit's
# RuntimeDirectory and StateDirectory are attnd/N, the ports come from the
# instance's config file, by convention 7411 + 2N (RPC) and 7412 + 2N (metrics).
RPC_PORT_BASE = 7411
METRICS_PORT_BASE = 7412


def instance_socket(n: int) -> str:
    """The Unix socket of attnd@N ($RUNTIME_DIRECTORY of the unit, /run/attnd/N)."""
    return f"/run/attnd/{int(n)}/attnd.sock"


def instance_state_dir(n: int) -> str:
    """The state directory of attnd@N ($STATE_DIRECTORY, /var/lib/attnd/N)."""
    return f"/var/lib/attnd/{int(n)}"


def instance_ports(n: int) -> Tuple[int, int]:
    """(TCP port, metrics port) of attnd@N by the scheme: 7411 + 2N, 7412 + 2N."""
    return RPC_PORT_BASE + 2 * int(n), METRICS_PORT_BASE + 2 * int(n)


def parse_range(text) -> Optional[Tuple[int, int]]:
    """ "A:B" -> (A, B) with 0 <= A < B; None or "" -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, (list, tuple)) and len(text) == 2:
        a, b = int(text[0]), int(text[1])
    else:
        parts = str(text).split(":")
        if len(parts) != 2:
            raise ValueError(f"kv head range {text!r}: want A:B")
        try:
            a, b = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"kv head range {text!r}: want A:B with integers") from None
    if not 0 <= a < b:
        raise ValueError(f"kv head range {text!r}: want 0 <= A < B")
    return a, b


@dataclasses.dataclass
class Daemon:
    """One daemon of a fleet."""

    name: str
    address: str
    kv_heads: Optional[Tuple[int, int]] = None
    group: Optional[str] = None
    weight: int = 1
    timeout: Optional[float] = None
    token: Optional[str] = None

    def connect(self, **kw):
        """A Client connected to this daemon (keyword arguments go to attnd.Client)."""
        from .client import Client

        kw.setdefault("timeout", self.timeout)
        kw.setdefault("token", self.token)
        return Client(self.address, **kw)


class FleetError(ValueError):
    """A fleet file that does not describe a usable set of daemons."""


@dataclasses.dataclass
class Fleet:
    daemons: List[Daemon]

    def group(self, name=None) -> List[Daemon]:
        """The daemons of a group in file order (None: every daemon)."""
        if name is None:
            return list(self.daemons)
        ds = [d for d in self.daemons if d.group == name]
        if not ds:
            raise FleetError(f"no daemon is in group {name!r}")
        return ds

    def groups(self) -> dict:
        """{group name: [Daemon]} in file order; daemons without a group are left out."""
        out = {}
        for d in self.daemons:
            if d.group is not None:
                out.setdefault(d.group, []).append(d)
        return out

    def by_name(self, name) -> Daemon:
        for d in self.daemons:
            if d.name == name:
                return d
        raise KeyError(name)

    @staticmethod
    def local(instances: int, **defaults) -> "Fleet":
        """attnd@0 .. attnd@N-1 on this host by their sockets."""
        return Fleet([Daemon(name=f"attnd@{i}", address=instance_socket(i), **defaults)
                      for i in range(int(instances))])

    @staticmethod
    def from_dict(doc: dict, base_dir: str = ".") -> "Fleet":
        if not isinstance(doc, dict):
            raise FleetError("a fleet file is a table at the top")
        known = {"defaults", "local", "daemon"}
        extra = set(doc) - known
        if extra:
            raise FleetError(f"unknown top-level keys {sorted(extra)} (known: {sorted(known)})")
        defaults = doc.get("defaults", {}) or {}
        bad = set(defaults) - {"timeout", "token_file", "token"}
        if bad:
            raise FleetError(f"unknown keys in [defaults]: {sorted(bad)}")
        token = defaults.get("token")
        if defaults.get("token_file"):
            path = os.path.join(base_dir, defaults["token_file"])
            try:
                with open(path) as f:
                    token = f.read().strip()
            except OSError as e:
                raise FleetError(f"token_file {path}: {e}") from None
        common = {"timeout": defaults.get("timeout"), "token": token}
        daemons = []
        local = doc.get("local")
        if local is not None:
            n = local.get("instances")
            if not isinstance(n, int) or n < 1:
                raise FleetError("[local] instances must be an integer >= 1")
            daemons += Fleet.local(n, **common).daemons
        for i, d in enumerate(doc.get("daemon", []) or []):
            bad = set(d) - {"name", "address", "kv_heads", "group", "weight"}
            if bad:
                raise FleetError(f"daemon {i}: unknown keys {sorted(bad)}")
            if not d.get("address"):
                raise FleetError(f"daemon {i}: address is required")
            weight = d.get("weight", 1)
            if not isinstance(weight, int) or weight < 1:
                raise FleetError(f"daemon {i}: weight must be an integer >= 1")
            try:
                rng = parse_range(d.get("kv_heads"))
            except ValueError as e:
                raise FleetError(f"daemon {i}: {e}") from None
            daemons.append(Daemon(name=str(d.get("name") or d["address"]), address=str(d["address"]),
                                  kv_heads=rng, group=d.get("group"), weight=weight, **common))
        if not daemons:
            raise FleetError("a fleet file lists no daemon ([[daemon]] or [local] instances)")
        names = [d.name for d in daemons]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise FleetError(f"daemon names must be unique: {dup}")
        return Fleet(daemons)

    @staticmethod
    def load(path: str) -> "Fleet":
        """Reads a fleet file: TOML, or JSON when the name ends in .json."""
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise FleetError(f"fleet file {path}: {e}") from None
        try:
            if path.endswith(".json"):
                doc = json.loads(raw)
            else:
                if tomllib is None:
                    raise FleetError("TOML needs Python 3.11 (tomllib); use a .json fleet file")
                doc = tomllib.loads(raw.decode())
        except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
            if isinstance(e, FleetError):
                raise
            raise FleetError(f"fleet file {path}: {e}") from None
        return Fleet.from_dict(doc, os.path.dirname(os.path.abspath(path)))
