"""`python -m fate_rdma.cli ...` is the same as the `fate-rdma` console script."""
import sys

from . import main

sys.exit(main())
