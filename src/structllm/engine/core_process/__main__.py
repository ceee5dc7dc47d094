"""``python -m structllm.engine.core_process --fd N``."""

import sys

from structllm.engine.core_process.loop import main

sys.exit(main())
