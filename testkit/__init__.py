"""What several test modules, the chaos runs and the benchmarks share (no test module imports
another's helpers): a dispatcher driven by hand (:mod:`testkit.dispatcher`), a service in
its own process (:mod:`testkit.service`) and the fault-injecting dataset double
(:mod:`testkit.fault_source`). Imported from the repository root, where ``tests`` is a
package; nothing here is part of the installed product."""
