"""Runnable examples: the Flower app (examples/flower_app/) and the extension guide's modules (examples/extending/).

A regular package, so that ``examples.extending...`` resolves here and not to the ``examples``
package that Opacus installs into site-packages.
"""
