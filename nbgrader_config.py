"""nbgrader settings for ZeRO from Scratch (the course root is this folder).

solutions/<lesson>/<lesson>.ipynb  instructor source (solutions, hidden tests, points)
lessons/<lesson>/<lesson>.ipynb    what students get: `make lessons` regenerates it
submitted/<student>/<lesson>/      what `make grade` autogrades
"""

c = get_config()  # noqa: F821 (nbgrader provides it)

c.CourseDirectory.root = "."
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
