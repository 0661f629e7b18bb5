"""Offline data for the lessons: nothing here downloads anything.

* ``sequences``: synthetic token tasks generated in code (lessons 02, 05, 08, 11);
* ``images``: scikit-learn's bundled handwritten digits (lesson 09);
* ``audio``: telephone-keypad tone sequences synthesised in code (lesson 10).

Import what you need from the submodules, e.g. ``from attn_course.data.sequences import ...``.
"""
