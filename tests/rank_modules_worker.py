"""Run a compiled training program as one rank of torchrun, then write the modules the rank imported.

``python -m torch.distributed.run --nproc-per-node N tests/rank_modules_worker.py OUT_DIR DIR/train.py [args]``
writes ``OUT_DIR/rank<R>.json`` (sorted ``sys.modules``) on every rank and exits with the program's code.
"""

import json
import os
import runpy
import sys
from pathlib import Path

out, program, *args = sys.argv[1:]
sys.argv = [program, *args]
code = 0
try:
    runpy.run_path(program, run_name="__main__")
except SystemExit as exit_:
    code = exit_.code or 0
finally:
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(sorted(sys.modules)))
sys.exit(code)
