"""scripts/gpu-relay-tree, in a clone of this repository: `hide` leaves only
the benchmark's one fixture file tracked and refuses commits (one would
delete the fixtures); `restore` brings the index back to HEAD, and nothing
is committed either way."""

import re
import subprocess

from conftest import ROOT


def _git(cwd, *args, check=True):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check)


def test_hide_and_restore_in_a_clone(tmp_path):
    repo = tmp_path / "r"
    _git(tmp_path, "clone", "-q", "--no-hardlinks", str(ROOT), str(repo))
    head = _git(repo, "rev-parse", "HEAD").stdout
    tracked = _git(repo, "ls-files", "tests/fixtures").stdout.split()
    assert len(tracked) > 100

    def tree(*args):
        return subprocess.run(["bash", "scripts/gpu-relay-tree", *args], cwd=repo, capture_output=True, text=True)

    # No .gpuN here: `check` weighs the tree alone (about 54 MB, under the
    # device's 64 MiB) and fails exactly when that is over the limit, saying
    # to hide.
    def weigh():
        check = tree("check")
        total, limit = (int(n) for n in re.search(r"= (\d+) of (\d+)", check.stdout).groups())
        assert limit == 64 * 1024 * 1024
        assert check.returncode == (1 if total > limit else 0), check
        assert ("scripts/gpu-relay-tree hide" in check.stderr) == (total > limit)
        return total, limit

    total, limit = weigh()
    assert total > 10_000_000
    # An untracked file travels too: one that brings the tree to the limit
    # passes, one byte more fails (whichever side the tree itself is on).
    pad = repo / "pad.bin"
    for size in (limit - total, limit - total + 1):
        if size >= 0:
            pad.write_bytes(bytes(size))
            assert weigh()[0] == total + size
    pad.unlink(missing_ok=True)
    hide = tree("hide")
    assert hide.returncode == 0, hide.stderr
    assert _git(repo, "ls-files", "tests/fixtures").stdout.split() == ["tests/fixtures/tiny-qwen3/tokenizer.json"]
    # The untracked fixtures do not travel: ignored, not offered as new files.
    assert _git(repo, "ls-files", "--others", "--exclude-standard", "tests").stdout == ""
    assert "working tree" in hide.stdout
    # Hidden, the tree is a few MB: far under the limit (hide's own check passed).
    hidden = int(re.search(r"working tree (\d+) bytes", hide.stdout).group(1))
    assert hidden < 16 * 1024 * 1024, hide.stdout
    refused = _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x",
                   check=False)
    assert refused.returncode != 0 and "restore first" in refused.stderr
    assert tree("hide").returncode != 0  # not twice
    assert tree("restore").returncode == 0
    assert _git(repo, "ls-files", "tests/fixtures").stdout.split() == tracked
    assert _git(repo, "status", "--porcelain").stdout == ""
    assert _git(repo, "rev-parse", "HEAD").stdout == head
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
