"""Analysis: what the stored runs say — calibration math and its versions, rankings,
reports and the results table."""
