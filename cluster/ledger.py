"""``python3 -m cluster.ledger register``: a hand-run job's ledger record, as the batch scripts of jobs submitted
before cluster/ became packages (3239243) call it; a job queued or requeued across that upgrade still runs it. The
entry points a batch script calls are a stable interface (docs/architecture.md, "What a batch script calls"); this
one stays until no job of that release can be queued (a week after it is replaced everywhere).
"""

import sys

from cluster.job.ledger import main

if __name__ == "__main__":
    sys.exit(main())
