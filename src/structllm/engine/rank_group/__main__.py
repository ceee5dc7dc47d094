"""``python -m structllm.engine.rank_group``: a follower rank."""

import sys

from structllm.engine.rank_group.follower import main

sys.exit(main())
