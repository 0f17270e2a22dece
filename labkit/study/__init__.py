"""Study: the quiz, the exercises and diagnosis labs, and the workshop leaderboard."""
