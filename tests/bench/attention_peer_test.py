#!/usr/bin/env python3
"""attention_peer.py merge on small files (no GPU): the speed-ups and target flags it derives, the
date it stamps, and its refusal to join timings taken after different L2 flushes or at different
geometries or without an anchor for a case; and that its default shapes are the C++
benchmarks' (ctest attention_peer_merge)."""
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import unittest

SCRIPT = pathlib.Path(__file__).resolve().parent / "attention_peer.py"


def kvpool_file(flush):
    cases = [{"batch": 1, "context": 32768, "format": "int4_rot128", "ms": 0.015,
              "frac_stream": 0.82},
             {"batch": 1, "context": 32768, "format": "fp8_rot128", "ms": 0.03,
              "frac_stream": 0.6}]
    d = {"cases": cases}
    if flush is not None:
        d["l2_flush"] = flush
    return d


def peer_file(flush):
    d = {"flashinfer": "test", "cases": [
        {"batch": 1, "context": 32768, "sdpa_flash_fp16": {"ms": 0.05},
         "flashinfer_tc_fp16": {"ms": 0.04}}]}
    if flush is not None:
        d["l2_flush"] = flush
    return d


class MergeTest(unittest.TestCase):
    def merge(self, kv, peer):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = pathlib.Path(tmp)
            (tmp / "kv.json").write_text(json.dumps(kv))
            (tmp / "peer.json").write_text(json.dumps(peer))
            r = subprocess.run([sys.executable, str(SCRIPT), "merge", "--kvpool",
                                str(tmp / "kv.json"), "--peer", str(tmp / "peer.json"), "--out",
                                str(tmp / "out.json")], capture_output=True, text=True)
            out = json.loads((tmp / "out.json").read_text()) if r.returncode == 0 else None
            return r, out

    def test_speedups_and_targets(self):
        r, out = self.merge(kvpool_file("read"), peer_file("read"))
        self.assertEqual(r.returncode, 0, r.stderr)
        int4, fp8 = out["cases"]
        self.assertAlmostEqual(int4["speedup_vs_sdpa"], 0.05 / 0.015)
        self.assertTrue(int4["speedup_met"])  # 3.33x >= 3.3x
        self.assertTrue(int4["stream_met"])  # 82% >= 80%
        self.assertAlmostEqual(int4["speedup_vs_flashinfer_tc_fp16"], 0.04 / 0.015)
        self.assertAlmostEqual(fp8["speedup_vs_sdpa"], 0.05 / 0.03)
        self.assertFalse(fp8["speedup_met"])  # 1.67x < 1.8x
        self.assertEqual(out["kvpool"]["l2_flush"], "read")
        # render_tables.py shows the newest merged file by this date.
        self.assertRegex(out["date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")

    def test_files_without_the_flag_count_as_zeroing_flush(self):
        r, _ = self.merge(kvpool_file(None), peer_file("write"))
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_different_flushes_are_refused(self):
        r, out = self.merge(kvpool_file("read"), peer_file(None))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("different L2 flushes", r.stderr)
        self.assertIsNone(out)

    def test_different_geometries_are_refused(self):
        kv = dict(kvpool_file("read"), q_heads=64, kv_heads=8, head_dim=128)
        r, out = self.merge(kv, peer_file("read"))  # the peer file: the issue's geometry
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("different geometries", r.stderr)
        self.assertIsNone(out)

    def test_cases_without_an_anchor_are_refused(self):
        kv = kvpool_file("read")
        kv["cases"].append(dict(kv["cases"][0], batch=8, context=8192))
        r, out = self.merge(kv, peer_file("read"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("without an anchor", r.stderr)
        self.assertIn("(8, 8192)", r.stderr)
        self.assertIsNone(out)

    def test_targets_only_at_the_issue_geometry(self):
        geo = {"q_heads": 64, "kv_heads": 8, "head_dim": 128}
        r, out = self.merge(dict(kvpool_file("read"), **geo), dict(peer_file("read"), **geo))
        self.assertEqual(r.returncode, 0, r.stderr)
        int4, _ = out["cases"]
        self.assertAlmostEqual(int4["speedup_vs_sdpa"], 0.05 / 0.015)
        self.assertNotIn("speedup_met", int4)
        self.assertNotIn("stream_met", int4)
        self.assertEqual(out["kvpool"]["q_heads"], 64)


class ShapesTest(unittest.TestCase):
    def test_default_shapes_are_the_cpp_benchmarks(self):
        header = (SCRIPT.parents[2] / "tests" / "common" / "bench_output.h").read_text()
        body = re.search(r"kDecodeShapes\[\] = \{(.*?)\};", header, re.S).group(1)
        cpp = [f"{b}x{c}" for b, c in re.findall(r"\{(\d+), (\d+)\}", body)]
        sys.path.insert(0, str(SCRIPT.parent))
        import attention_peer
        self.assertEqual(attention_peer.SHAPES.split(","), cpp)


if __name__ == "__main__":
    unittest.main()
