"""`workload-manager lint-migrations`, the step of `make lint` that holds each migration to
the kind it declares: a refusal names the file and the reason, and the project's own
migrations pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import cli
from standins.databases import MIGRATIONS


def lint(directory: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["lint-migrations", str(directory)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_projects_migrations_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = lint(MIGRATIONS, capsys)
    assert (code, err) == (0, "")
    assert f"in {MIGRATIONS}: each declares its kind" in out


def test_an_expand_migration_that_contracts_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "0001_table.sql").write_text("-- kind: expand\nCREATE TABLE t (n int);\n")
    (tmp_path / "0002_drop.sql").write_text("-- kind: expand\nALTER TABLE t DROP COLUMN n;\n")
    code, out, err = lint(tmp_path, capsys)
    assert (code, out) == (1, "")
    assert err == (f"workload-manager: {tmp_path}: 0002_drop.sql: an expand migration holds DROP\n")


def test_a_contract_without_the_release_it_waits_for_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "0001_drop.sql").write_text("-- kind: contract\nDROP TABLE t;\n")
    (tmp_path / "0002_later.sql").write_text("CREATE TABLE u (n int);\n")
    code, _, err = lint(tmp_path, capsys)
    assert code == 1
    assert "0001_drop.sql: a contract migration declares no `-- requires-nodes-at-least" in err
    assert "0002_later.sql: no `-- kind: expand` or `-- kind: contract` line" in err


def test_a_misnamed_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "7_later.sql").write_text("-- kind: expand\nCREATE TABLE u (n int);\n")
    code, _, err = lint(tmp_path, capsys)
    assert code == 1
    assert "7_later.sql: migration files are named NNNN_name.sql" in err


def test_the_make_lint_target_runs_it() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    lint_target = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "-m app lint-migrations migrations" in lint_target
