"""What several test modules share (no test module imports another's helpers): a dispatcher
driven by hand (:mod:`tests.support.dispatcher`). Nothing here is part of the installed product."""
