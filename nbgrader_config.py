"""nbgrader settings for ZeRO from Scratch (the course root is this folder).

solutions/<lesson>/<lesson>.ipynb  instructor source (solutions, hidden tests, points)
lessons/<lesson>/<lesson>.ipynb    what students get: `make lessons` regenerates it
submitted/<student>/<lesson>/      what `make grade` autogrades

Every nbgrader command run here (autograde, generate_feedback, release_feedback, export,
the formgrader) grades and gives feedback as `make grade` does: see grade_as_the_course.
A course folder of its own (`make grade ... --course-dir DIR`) gets an nbgrader_config.py
that loads this one and names its own folders.
"""

import os

from zerokit.grading.autograde.settings import grade_as_the_course

c = get_config()  # noqa: F821 (nbgrader provides it)

# absolute: nbgrader warns "root '.' is not absolute" on every command otherwise, and a
# subconfig loaded from another folder must still mean this one
HERE = os.path.dirname(os.path.abspath(__file__))

c.CourseDirectory.root = HERE
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "lessons"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.course_id = "zero-from-scratch"

# What a student sees where a solution was.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Multi-rank checks start processes and train for a few steps: give a cell time, but a
# hung cell still fails (each check also has its own, shorter timeout).
c.ExecutePreprocessor.timeout = 300
c.Execute.timeout = 300

# Autograde with the course's execution (per-cell timeouts, one-line reasons, each kernel in
# safe-path mode behind bubblewrap) and cell restoring; feedback without the hidden tests.
grade_as_the_course(c)

# Late submissions: nbgrader's default flags them and takes nothing off. To take points off,
# set a due date (`nbgrader db assignment add LESSON --duedate=...` or the formgrader) and e.g.
#   c.LateSubmissionPlugin.penalty_method = "zero"
# grades.csv then shows the score after the penalty, with the raw score and penalty beside it.
