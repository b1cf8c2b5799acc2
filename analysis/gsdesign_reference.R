# Reference boundaries from gsDesign (Anderson et al., CRAN), for the sequential design's test
# (tests/workbench/test_sequential.py reads tests/fixtures/gsdesign_boundaries.json).
#
#   Rscript analysis/gsdesign_reference.R OUT.json [GSDESIGN_SOURCE]
#
# With GSDESIGN_SOURCE (a checkout of https://github.com/keaven/gsDesign), its C code is built with R CMD SHLIB
# and its R files are sourced, so that neither CRAN nor gsDesign's plotting and table dependencies are needed;
# without it, library(gsDesign). Each case is a symmetric two-sided design at two-sided alpha (gsDesign's
# one-sided alpha / 2 per side, test.type = 2): the increments of the spending function at the information
# fractions go to gsBound, the routine gsDesign() itself calls for such a design. Where the last fraction is 1,
# gsDesign(k, test.type = 2, ...) at its default precision is called too and must agree to 1e-5.
args <- commandArgs(trailingOnly = TRUE)
out <- args[1]
if (length(args) >= 2) {
  src <- normalizePath(args[2])
  build <- file.path(tempdir(), "gsDesign_src")
  dir.create(build)
  file.copy(list.files(file.path(src, "src"), full.names = TRUE), build)
  so <- file.path(build, "gsDesign.so")
  stopifnot(system2("R", c("CMD", "SHLIB", "-o", so, list.files(build, "\\.c$", full.names = TRUE)),
                    stdout = FALSE) == 0)
  dyn.load(so)
  for (f in list.files(file.path(src, "R"), "\\.R$", full.names = TRUE)) source(f)
  version <- read.dcf(file.path(src, "DESCRIPTION"), fields = "Version")[1, 1]
  commit <- system2("git", c("-C", src, "rev-parse", "HEAD"), stdout = TRUE)
} else {
  library(gsDesign)
  version <- as.character(packageVersion("gsDesign"))
  commit <- "CRAN"
}

cases <- list(
  list(name = "claims plan: 10/20/30/45/60 of 60 seeds", spending = "obrien_fleming", alpha = 0.05,
       t = c(10, 20, 30, 45, 60) / 60),
  list(name = "a failed cell at looks 1 and 3: 9/20/29/45/60 of 60", spending = "obrien_fleming", alpha = 0.05,
       t = c(9, 20, 29, 45, 60) / 60),
  list(name = "three looks at 0.25, 0.6, 1", spending = "obrien_fleming", alpha = 0.05, t = c(0.25, 0.6, 1)),
  list(name = "four looks at 0.3, 0.45, 0.8, 1", spending = "obrien_fleming", alpha = 0.05, t = c(0.3, 0.45, 0.8, 1)),
  list(name = "alpha 0.1 at 0.2, 0.5, 1", spending = "obrien_fleming", alpha = 0.1, t = c(0.2, 0.5, 1)),
  list(name = "a plan ended short of its cap: 10/20/30/42 of 60", spending = "obrien_fleming", alpha = 0.05,
       t = c(10, 20, 30, 42) / 60),
  list(name = "Pocock at 10/20/30/45/60 of 60", spending = "pocock", alpha = 0.05, t = c(10, 20, 30, 45, 60) / 60),
  list(name = "Pocock at 0.3, 0.45, 0.8, 1", spending = "pocock", alpha = 0.05, t = c(0.3, 0.45, 0.8, 1))
)
sf <- list(obrien_fleming = sfLDOF, pocock = sfLDPocock)

rows <- character(0)
for (cs in cases) {
  fn <- sf[[cs$spending]]
  side <- cs$alpha / 2
  incr <- diff(c(0, fn(side, cs$t)$spend))
  b <- gsBound(I = cs$t, trueneg = incr, falsepos = incr, tol = 1e-10, r = 80)
  stopifnot(b$error == 0, isTRUE(all.equal(-b$a, b$b)))
  if (abs(tail(cs$t, 1) - 1) < 1e-12) {
    d <- gsDesign(k = length(cs$t), test.type = 2, alpha = side, sfu = fn, timing = cs$t)  # its defaults
    stopifnot(max(abs(d$upper$bound - b$b)) < 1e-5)
  }
  rows <- c(rows, sprintf('    {"name": "%s", "spending": "%s", "alpha": %s, "fractions": [%s], "bounds": [%s]}',
                          cs$name, cs$spending, format(cs$alpha), paste(sprintf("%.15g", cs$t), collapse = ", "),
                          paste(sprintf("%.10f", b$b), collapse = ", ")))
}
meta <- sprintf('  "source": "gsDesign %s (%s), gsBound with sfLDOF / sfLDPocock at alpha / 2 per side, tol 1e-10, r 80; %s",\n',
                version, commit, R.version.string)
cat("{\n", meta, '  "cases": [\n', paste(rows, collapse = ",\n"), "\n  ]\n}\n", sep = "", file = out)
cat("wrote", out, "\n")
