"""Placement on the consistent-hash ring (attnd.placement) and fleet files (attnd.fleet).

The ring's movement bound needs no daemon: keys are first-block hashes of random
prompts. The epoch and removal tests run against the protocol fake.
"""
import json
import os
import random
import shutil
import tempfile
import unittest

import numpy as np

import attnd
from attnd.fleet import Daemon, Fleet, FleetError, instance_ports, instance_socket
from fake_attnd import FakeAttnd

try:
    from attnd.placement import Placement, prefix_key
except ImportError as e:  # uhashring missing (Debian: python3-uhashring)
    Placement = None
    MISSING = str(e)

SEED = int(os.environ.get("ATTND_TEST_SEED", random.SystemRandom().getrandbits(31)))
BS = 16


def ring(n, weights=None):
    none = lambda: None  # noqa: E731 - no connection needed for node_for()
    return Placement({f"d{i}": (none, (weights or [1] * n)[i]) for i in range(n)}, block_size=BS)


@unittest.skipIf(Placement is None, "uhashring is not installed")
class RingTest(unittest.TestCase):
    def setUp(self):
        print(f"seed {SEED}")
        self.rng = random.Random(SEED)
        self.prompts = [[self.rng.randrange(1 << 17) for _ in range(BS + self.rng.randrange(40))]
                        for _ in range(4000)]

    def owners(self, pl):
        return [pl.node_for(p) for p in self.prompts]

    def test_shared_first_block_same_daemon(self):
        pl = ring(5)
        for p in self.prompts[:200]:
            other = p[:BS] + [self.rng.randrange(1 << 17) for _ in range(30)]
            self.assertEqual(pl.node_for(p), pl.node_for(other))
        # The salt is part of the key: some salted copies move.
        moved = sum(pl.node_for(p) != pl.node_for(p, salt=b"tenant-b") for p in self.prompts[:400])
        self.assertGreater(moved, 100)

    def test_key_is_first_block_and_salt(self):
        self.assertEqual(prefix_key(list(range(40)), BS), prefix_key(list(range(BS)), BS))
        self.assertNotEqual(prefix_key(list(range(BS)), BS), prefix_key(list(range(1, BS + 1)), BS))
        self.assertNotEqual(prefix_key([1, 2], BS, b"a"), prefix_key([1, 2], BS, b"b"))
        # The salt's length is hashed, so salt/tokens boundaries cannot be shifted.
        self.assertNotEqual(prefix_key([0x64636261], BS, b""), prefix_key([], BS, b"abcd"))

    def test_balanced(self):
        n = 5
        counts = {k: 0 for k in (f"d{i}" for i in range(n))}
        for o in self.owners(ring(n)):
            counts[o] += 1
        for k, c in counts.items():
            self.assertLess(abs(c / len(self.prompts) - 1 / n), 0.35 / n, counts)

    def test_remove_moves_only_its_share(self):
        for n in (3, 5, 8):
            pl = ring(n)
            before = self.owners(pl)
            gone = f"d{self.rng.randrange(n)}"
            pl.remove_node(gone)
            after = self.owners(pl)
            moved = [i for i in range(len(before)) if before[i] != after[i]]
            # Exactly the removed daemon's keys move, nothing else ...
            self.assertEqual(moved, [i for i in range(len(before)) if before[i] == gone])
            self.assertNotIn(gone, after)
            # ... and that is about 1/n of them (bounded, not only "some").
            frac = len(moved) / len(before)
            print(f"n={n}: removing {gone} moved {frac:.3f} of the keys (1/n = {1 / n:.3f})")
            self.assertLess(frac, 1.35 / n)
            self.assertGreater(frac, 0.65 / n)

    def test_add_takes_only_its_share(self):
        pl = ring(4)
        before = self.owners(pl)
        pl.add_node("d4", lambda: None, 1)
        after = self.owners(pl)
        moved = [i for i in range(len(before)) if before[i] != after[i]]
        self.assertTrue(all(after[i] == "d4" for i in moved))
        self.assertLess(len(moved) / len(before), 1.35 / 5)

    def test_weight(self):
        counts = {}
        for o in self.owners(ring(3, [1, 1, 2])):
            counts[o] = counts.get(o, 0) + 1
        self.assertGreater(counts["d2"], 1.5 * max(counts["d0"], counts["d1"]), counts)


@unittest.skipIf(Placement is None, "uhashring is not installed")
class EpochTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="attnd-place-")
        self.fakes = [FakeAttnd(os.path.join(self.tmp, f"f{i}.sock")) for i in range(3)]
        self.fleet = Fleet([Daemon(f"f{i}", f.path) for i, f in enumerate(self.fakes)])
        self.replays = []
        self.pl = Placement.from_fleet(self.fleet, on_replay=lambda n, s, why: self.replays.append((n, s, why)))

    def tearDown(self):
        self.pl.close()
        for f in self.fakes:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def open_many(self, k=30):
        rng = random.Random(SEED)
        return [self.pl.open_session([rng.randrange(1000) for _ in range(20)]) for _ in range(k)]

    def test_sessions_follow_the_ring(self):
        sess = self.open_many()
        for s in sess:
            self.assertEqual(s.node, self.pl.node_for(s.tokens))
            fake = self.fakes[int(s.node[1:])]
            self.assertIn(s.id, fake.sessions)
        self.pl.close_session(sess[0])
        self.assertNotIn(sess[0].id, self.fakes[int(sess[0].node[1:])].sessions)

    def test_restart_calls_replay_policy(self):
        sess = self.open_many()
        victim = sess[0].node
        on_victim = {s.id for s in sess if s.node == victim}
        self.fakes[int(victim[1:])].restart()
        self.pl.check()  # Health on every daemon notices the new epoch
        self.assertEqual(len(self.replays), 1)
        node, lost, why = self.replays[0]
        self.assertEqual((node, why), (victim, "restarted"))
        self.assertEqual({s.id for s in lost}, on_victim)
        self.assertTrue(all(s.gone for s in lost))
        self.assertEqual({s.id for s in self.pl.sessions()}, {s.id for s in sess} - on_victim)
        # The policy replays: reopen with the same prompt lands on the same daemon.
        again = self.pl.open_session(lost[0].tokens)
        self.assertEqual(again.node, victim)
        # A second check sees no change and calls nothing.
        self.pl.check()
        self.assertEqual(len(self.replays), 1)

    def test_restart_noticed_by_a_failing_call(self):
        sess = self.open_many(10)
        s = sess[0]
        self.fakes[int(s.node[1:])].restart()
        with self.assertRaises(attnd.NotFound):
            self.pl.client(s.node).truncate(s.id, 0)
        self.assertEqual(self.replays[0][0], s.node)
        self.assertIn(s.id, {x.id for x in self.replays[0][1]})

    def test_remove_hands_sessions_to_policy(self):
        sess = self.open_many()
        gone = sess[0].node
        moved = self.pl.remove_node(gone)
        self.assertEqual({s.id for s in moved}, {s.id for s in sess if s.node == gone})
        self.assertEqual(self.replays[-1][2], "removed")
        for s in moved:
            self.assertNotEqual(self.pl.node_for(s.tokens), gone)


@unittest.skipIf(Placement is None, "uhashring is not installed")
class GroupNodesTest(unittest.TestCase):
    """Ring nodes that are head-sharded groups (a ShardedClient each)."""

    def setUp(self):
        from scaleout_fake import ScaleoutFake
        from fake_attnd import shape
        self.tmp = tempfile.mkdtemp(prefix="attnd-place-")
        self.fakes, ds = [], []
        for g in ("ga", "gb"):
            for i in range(2):
                f = ScaleoutFake(os.path.join(self.tmp, f"{g}{i}.sock"), shape(q_heads=2, kv_heads=1),
                                 kv_range=(i, i + 1, 4, 2))
                self.fakes.append(f)
                ds.append(Daemon(f"{g}{i}", f.path, group=g))
        self.replays = []
        self.pl = Placement.from_fleet(Fleet(ds), on_replay=lambda n, s, why: self.replays.append((n, s, why)))

    def tearDown(self):
        self.pl.close()
        for f in self.fakes:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_groups_are_nodes(self):
        self.assertEqual(sorted(self.pl.nodes), ["ga", "gb"])
        rng = random.Random(SEED)
        sess = [self.pl.open_session([rng.randrange(1000) for _ in range(20)]) for _ in range(12)]
        self.assertEqual({s.node for s in sess}, {"ga", "gb"})
        s = sess[0]
        sh = self.pl.client(s.node)
        self.assertEqual((sh.model.q_heads, sh.model.kv_heads), (4, 2))
        # Every daemon of the group holds the session.
        idx = 0 if s.node == "ga" else 2
        self.assertEqual(len(self.fakes[idx].sessions), len(self.fakes[idx + 1].sessions))
        # A restart of one shard ends the group's sessions: the policy gets them
        # and the group's own client marks them stale.
        self.fakes[idx + 1].restart()
        self.pl.check()
        node, lost, why = self.replays[0]
        self.assertEqual((node, why), (s.node, "restarted"))
        self.assertEqual({x.id for x in lost}, {x.id for x in sess if x.node == s.node})
        self.assertTrue(sh.stale(s.id))


class FleetTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="attnd-fleet-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def write(self, name, text):
        p = os.path.join(self.tmp, name)
        with open(p, "w") as f:
            f.write(text)
        return p

    def test_toml(self):
        self.write("tok", "s3cret\n")
        p = self.write("fleet.toml", """
[defaults]
timeout = 12
token_file = "tok"

[local]
instances = 2

[[daemon]]
name = "a"
address = "10.0.0.5:7411"
kv_heads = "0:4"
group = "g"

[[daemon]]
address = "10.0.0.6:7411"
kv_heads = "4:8"
group = "g"
weight = 3
""")
        f = Fleet.load(p)
        self.assertEqual([d.name for d in f.daemons], ["attnd@0", "attnd@1", "a", "10.0.0.6:7411"])
        self.assertEqual(f.daemons[1].address, "/run/attnd/1/attnd.sock")
        self.assertEqual(f.daemons[2].kv_heads, (0, 4))
        self.assertEqual(f.daemons[3].weight, 3)
        self.assertTrue(all(d.token == "s3cret" and d.timeout == 12 for d in f.daemons))
        self.assertEqual([d.name for d in f.groups()["g"]], ["a", "10.0.0.6:7411"])
        self.assertEqual(len(f.group()), 4)

    def test_json(self):
        p = self.write("fleet.json", json.dumps({"daemon": [{"address": "/x.sock", "kv_heads": [0, 2]}]}))
        self.assertEqual(Fleet.load(p).daemons[0].kv_heads, (0, 2))

    def test_scheme(self):
        self.assertEqual(instance_socket(3), "/run/attnd/3/attnd.sock")
        self.assertEqual(instance_ports(0), (7411, 7412))
        self.assertEqual(instance_ports(3), (7417, 7418))

    def test_errors(self):
        for text, what in (("", "no daemon"), ("[[daemon]]\nname='x'\n", "address"),
                           ("[[daemon]]\naddress='a'\nkv_heads='4:2'\n", "0 <= A < B"),
                           ("[[daemon]]\naddress='a'\nkv_heads='x'\n", "A:B"),
                           ("[[daemon]]\naddress='a'\nport=1\n", "unknown keys"),
                           ("[[daemon]]\naddress='a'\n[[daemon]]\naddress='a'\n", "unique"),
                           ("[local]\ninstances=0\n", "instances"),
                           ("[[daemon]]\naddress='a'\nweight=0\n", "weight"),
                           ("deamon = 1\n", "unknown top-level"),
                           ("[[daemon]\n", "fleet file")):
            with self.subTest(text=text):
                with self.assertRaises(FleetError) as cm:
                    Fleet.load(self.write("bad.toml", text))
                self.assertIn(what, str(cm.exception))
        with self.assertRaises(FleetError):
            Fleet.load(os.path.join(self.tmp, "missing.toml"))


if __name__ == "__main__":
    unittest.main()
