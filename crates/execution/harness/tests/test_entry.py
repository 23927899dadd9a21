"""The package run as the evaluator runs it: `python HARNESS_DIR/kforge_harness`, the request on stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kforge_harness import protocol

HARNESS_DIR = Path(__file__).resolve().parent.parent
PACKAGE = HARNESS_DIR / "kforge_harness"


def run(*args: str, request: object = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    stdin = "" if request is None else json.dumps(request)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, str(PACKAGE), *args], input=stdin, capture_output=True, text=True, cwd=cwd, env=env
    )


def test_the_package_lists_its_specs_and_results():
    specs = run("--specs")
    assert specs.returncode == 0, specs.stderr
    assert json.loads(specs.stdout) == protocol.spec_fields()
    results = run("--results")
    assert results.returncode == 0, results.stderr
    assert json.loads(results.stdout) == protocol.result_fields()


def test_a_compile_stage_runs_with_the_harness_dir_first_on_sys_path(tmp_path, request_for):
    seen = tmp_path / "sys_path.json"
    candidate = tmp_path / "candidate.py"
    record = f"import json, sys\nwith open({str(seen)!r}, 'w') as f:\n    json.dump(sys.path, f)\n"
    candidate.write_text(record + "class ModelNew:\n    pass\n")
    result_path = tmp_path / "result.json"
    request = request_for("compile", result_path=str(result_path), candidate_path=str(candidate))
    finished = run(request=request, cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    result = json.loads(result_path.read_text())
    assert result["ok"] is True and result["protocol"] == protocol.PROTOCOL_VERSION, result
    assert {"import_torch", "wait", "import_candidate"} <= set(result["phases_ms"]), result
    # As when the harness was one file in the harness directory: that directory first, the package's not at all.
    path = json.loads(seen.read_text())
    assert path[0] == str(HARNESS_DIR), path
    assert str(PACKAGE) not in path, path


def test_a_failing_candidate_is_a_result_and_exit_status_3(tmp_path, request_for):
    candidate = tmp_path / "candidate.py"
    candidate.write_text("raise ValueError('broken at import')\n")
    result_path = tmp_path / "result.json"
    request = request_for("compile", result_path=str(result_path), candidate_path=str(candidate))
    finished = run(request=request, cwd=tmp_path)
    assert finished.returncode == 3, finished.stderr
    result = json.loads(result_path.read_text())
    assert (result["ok"], result["error_type"], result["phase"]) == (False, "ValueError", "run"), result
    assert "broken at import" in result["error"]
