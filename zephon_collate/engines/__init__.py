"""The package as stages of the data engines people scale to: Grain and Ray Data.

:mod:`zephon_collate.engines.grain` (needs the ``grain`` extra) and
:mod:`zephon_collate.engines.ray` (needs the ``ray`` extra) are imported on
demand; :mod:`zephon_collate.engines.state` holds what both share.
"""
