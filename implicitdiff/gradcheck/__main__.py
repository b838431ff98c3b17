"""`python -m implicitdiff.gradcheck`: run the gradient-check catalogue."""

from ._catalogue import main

raise SystemExit(main())
