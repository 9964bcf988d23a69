"""A GGUF file whose header passes check_supported but whose tensors disagree with its
hyperparameters: the converter process refuses it as an InvalidModelFile (exit status 2, a 400
for the client), where it used to die of an IndexError (a 500)."""

from __future__ import annotations

import json

from mlxr.shared.errors import InvalidModelFile
from mlxr.supervisor.store.conversions import _failure
from mlxr.supervisor.store.gguf.convert import check_supported, main
from tests.unit.store.gguf.test_hostile_gguf import LLAMA, NORM, gguf, tensor


def test_query_rows_that_do_not_match_the_heads_are_a_400(tmp_path, capsys):
    # found by fuzzing (scripts/fuzz_headers.py gguf-meta): llama's q/k row order (2 heads of
    # 16 rows) indexed an 8-row attn_q out of bounds
    src = tmp_path / "model.gguf"
    src.write_bytes(gguf(LLAMA, [NORM, tensor("blk.0.attn_q.weight", [32, 8], 0, 128)],
                         bytes(128 + 1024)))
    check_supported(src)  # the header itself is fine
    assert main([str(src), str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    expected = 'model.gguf: tensor "blk.0.attn_q.weight" has 8 rows where its heads need 32'
    assert json.loads(line) == {"error": expected, "kind": "invalid_model_file"}
    err = _failure(2, line)
    assert isinstance(err, InvalidModelFile) and err.status == 400 and err.message == expected
