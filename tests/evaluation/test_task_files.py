"""Reading a user's JSONL task file: what the file's bytes may hold, and splits that depend on the
records, not on where the file lives or which line a record is on."""

import json
import os
import shutil

import pytest

from kvplan.evaluation.runs import _search_on, eval_settings
from kvplan.evaluation.tasks import TaskError, read_jsonl, split_records, task_file_digest


def _records(n=12, ids=False):
    return [{"history": f"The secret number of record {i} is {7 * i}. " * 3, "question": f"Record {i}'s number?",
             "answer": str(7 * i), **({"id": f"r{i}"} if ids else {})} for i in range(n)]


def _write(path, recs, prefix=b"", newline="\n"):
    path.write_bytes(prefix + "".join(json.dumps(r) + newline for r in recs).encode())
    return path


def _answers(path, split, seed=0):
    return [r["answer"] for r in split_records(read_jsonl(path), split, seed=seed)]


def test_records_without_ids_split_the_same_under_another_name_or_with_blank_lines(tmp_path):
    """Their split was a hash of ``<file name>:<line>``: renaming the file or adding a blank line moved records
    between calibration and test (and started a new study instead of resuming)."""
    recs = _records()
    first = _write(tmp_path / "noid.jsonl", recs)
    renamed = tmp_path / "data.jsonl"
    shutil.copy(first, renamed)
    blank = tmp_path / "blank.jsonl"
    blank.write_bytes(b"\n\n" + first.read_bytes())
    for split in ("calibration", "validation", "test"):
        want = _answers(first, split, seed=3)
        assert _answers(renamed, split, seed=3) == want and _answers(blank, split, seed=3) == want, split
    assert sorted(a for s in ("calibration", "validation", "test") for a in _answers(first, s)) == sorted(
        r["answer"] for r in recs)


def test_records_with_ids_split_by_their_ids_as_before(tmp_path):
    """A file that names its records keeps the splits it had (a hash of the seed and the id)."""
    from kvplan.evaluation.tasks import _hash

    path = _write(tmp_path / "ids.jsonl", _records(ids=True))
    order = sorted(_records(ids=True), key=lambda r: _hash(f"kvplan-records:5:{r['id']}"))
    assert [r["id"] for r in split_records(read_jsonl(path), "calibration", seed=5)] == [r["id"] for r in order[:6]]


def test_a_record_given_twice_is_refused_naming_both_lines(tmp_path):
    """Copies of a record could land in calibration and test: the plan measured on data it was searched on."""
    recs = _records(4)
    path = _write(tmp_path / "dups.jsonl", recs + [recs[1]])
    with pytest.raises(TaskError, match=r"dups.jsonl:5: the same record as line 2 .*remove it"):
        read_jsonl(path)
    with pytest.raises(TaskError, match=r"dups.jsonl:5: the same record as line 2"):  # other ids do not hide it
        read_jsonl(_write(tmp_path / "dups.jsonl", [dict(r, id=f"x{i}") for i, r in enumerate(recs + [recs[1]])]))


def test_a_byte_order_mark_and_crlf_lines_read_as_plain_utf8(tmp_path):
    recs = _records(4)
    plain = read_jsonl(_write(tmp_path / "plain.jsonl", recs))
    bom = read_jsonl(_write(tmp_path / "bom.jsonl", recs, prefix=b"\xef\xbb\xbf", newline="\r\n"))
    assert [r["history"] for r in bom] == [r["history"] for r in plain] and [r["_line"] for r in bom] == [1, 2, 3, 4]


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_bytes_that_are_not_utf8_are_named_by_line(tmp_path, bom):
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps(r).encode() for r in _records(3)]
    lines[2] = lines[2].replace(b"secret", b"s\xe9cret")
    path.write_bytes(bom + b"\n".join(lines) + b"\n")
    offset = len(bom) + len(lines[0]) + len(lines[1]) + 2 + lines[2].index(b"\xe9")
    with pytest.raises(TaskError, match=rf"latin1.jsonl:3: not UTF-8 text \(.* at byte {offset} of the file\)"):
        read_jsonl(path)


def test_an_integer_json_cannot_convert_is_a_record_error_not_a_crash(tmp_path):
    """``"id": 111...1`` (5000 digits) raised Python's integer-conversion ValueError: an internal error, exit 1."""
    path = tmp_path / "bigid.jsonl"
    path.write_text('{"history": "h", "question": "q", "id": ' + "1" * 5000 + "}\n")
    with pytest.raises(TaskError, match=r"bigid.jsonl:1: not valid JSON \(Exceeds the limit .*digits"):
        read_jsonl(path)


@pytest.mark.parametrize("field", ["history", "question", "id", "choices", "images"])
def test_a_lone_surrogate_escape_is_named_with_its_field(tmp_path, field):
    """``"\\ud800"`` is valid JSON and decodes to a lone surrogate, which hashing the id (before the model
    loads) or the tokenizer (after) failed on with an internal error."""
    rec = dict(_records(1)[0], choices=["a", "b"], answer="a")
    rec[field] = ["bad \ud800", "b"] if field in ("choices", "images") else "bad \ud800"
    path = tmp_path / "surrogate.jsonl"
    path.write_text(json.dumps(rec) + "\n")  # json.dumps writes the escape
    assert "\\ud800" in path.read_text()
    with pytest.raises(TaskError, match=rf"surrogate.jsonl:1: field '{field}' is not valid Unicode text"):
        read_jsonl(path)


def test_a_pipe_as_the_task_file_is_not_called_a_directory(tmp_path):
    fifo = tmp_path / "task.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(TaskError, match=r"task.jsonl: task must be a JSONL file, not a regular file \(a pipe"):
        read_jsonl(fifo)
    with pytest.raises(TaskError, match=r"folder: task must be a JSONL file, not a directory"):
        read_jsonl(tmp_path.joinpath("folder").mkdir() or tmp_path / "folder")


def test_eval_finds_the_plans_search_under_another_path_by_the_files_bytes(tmp_path, monkeypatch):
    """``kvplan eval plan.yaml --task ./my.jsonl`` after ``kvplan search --task my.jsonl --seed 3``: the names
    differed, so eval drew seed 0's splits, whose test records the search had calibrated on, and said nothing."""
    import kvplan

    task = _write(tmp_path / "my.jsonl", _records(ids=True))
    monkeypatch.chdir(tmp_path)
    plan = kvplan.uniform_plan(kvplan.Geometry(2, 1, 64, ("full", "full"), "llama"), 4, 4)
    searched = plan.replace(metrics={"search": {"seed": 3, "task": {"name": "my.jsonl",
                                                                    "sha256": task_file_digest(task)}}})
    copy = tmp_path / "sub" / "renamed.jsonl"
    copy.parent.mkdir()
    shutil.copy(task, copy)
    for spelled in ("my.jsonl", "./my.jsonl", str(task), str(copy)):
        assert eval_settings(searched, spelled, None, None, None) == (
            {"seed": 3, "history_tokens": 512, "eval_tokens": 32}, ["seed"]), spelled
    _write(task, _records(ids=True)[:-1])  # the file changed since the search: its splits are not the search's
    assert _search_on(searched, "my.jsonl") == {} and eval_settings(searched, "my.jsonl", None, None, None)[1] == []
    legacy = plan.replace(metrics={"search": {"seed": 3, "task": {"name": "my.jsonl"}}})  # before digests: by name
    assert _search_on(legacy, "my.jsonl") and not _search_on(legacy, "./my.jsonl")
    assert task_file_digest("default") is None
