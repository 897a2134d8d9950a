/* fsops: a WASI command (wasm32-wasi, preview1) that applies file operations
 * given as arguments, in order, to the tree preopened as "/". Built by the
 * integration tests with Debian's clang + wasi-libc (integration/tests/wasi.rs);
 * the same operations run as shell commands in a Mode B session must
 * publish the same layer.
 *
 *   write PATH TEXT     create or truncate PATH, write TEXT
 *   append PATH TEXT    append TEXT to PATH (created if missing)
 *   cat PATH            copy PATH to stdout
 *   mkdir PATH          mkdir 0777 (umask applies)
 *   rm PATH             unlink
 *   rmdir PATH          rmdir
 *   rmtree PATH         remove a tree (children first)
 *   mv FROM TO          rename
 *   symlink TARGET PATH symlink
 *   try-read PATH       open PATH for reading: exit 0 if refused, 3 if it opened
 *   try-write PATH      create PATH: exit 0 if refused, 3 if it was created
 *   sleep MS            sleep MS milliseconds
 *   spin                loop forever
 *   hog                 allocate 1 MiB blocks forever (touching them)
 *   exit N              exit with status N
 *
 * A failing operation prints "fsops: OP PATH: strerror" on stderr and exits 1.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int fail(const char *op, const char *path) {
    fprintf(stderr, "fsops: %s %s: %s\n", op, path, strerror(errno));
    exit(1);
}

static void put(const char *path, const char *text, int flags) {
    int fd = open(path, O_WRONLY | O_CREAT | flags, 0666);
    if (fd < 0) fail("open", path);
    size_t n = strlen(text);
    if (write(fd, text, n) != (ssize_t)n) fail("write", path);
    if (close(fd) != 0) fail("close", path);
}

static void rmtree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) fail("lstat", path);
    if (!S_ISDIR(st.st_mode)) {
        if (unlink(path) != 0) fail("unlink", path);
        return;
    }
    DIR *d = opendir(path);
    if (!d) fail("opendir", path);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char child[4096];
        snprintf(child, sizeof child, "%s/%s", path, e->d_name);
        rmtree(child);
    }
    closedir(d);
    if (rmdir(path) != 0) fail("rmdir", path);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *op = argv[i];
#define ARG(k) (i + (k) < argc ? argv[i + (k)] : (fprintf(stderr, "fsops: %s needs %d arguments\n", op, k), exit(2), ""))
        if (!strcmp(op, "write")) { put(ARG(1), ARG(2), O_TRUNC); i += 2; }
        else if (!strcmp(op, "append")) { put(ARG(1), ARG(2), O_APPEND); i += 2; }
        else if (!strcmp(op, "cat")) {
            FILE *f = fopen(ARG(1), "r");
            if (!f) fail("cat", argv[i + 1]);
            char buf[4096]; size_t n;
            while ((n = fread(buf, 1, sizeof buf, f)) > 0) fwrite(buf, 1, n, stdout);
            fclose(f); i += 1;
        }
        else if (!strcmp(op, "mkdir")) { if (mkdir(ARG(1), 0777) != 0) fail("mkdir", argv[i + 1]); i += 1; }
        else if (!strcmp(op, "rm")) { if (unlink(ARG(1)) != 0) fail("rm", argv[i + 1]); i += 1; }
        else if (!strcmp(op, "rmdir")) { if (rmdir(ARG(1)) != 0) fail("rmdir", argv[i + 1]); i += 1; }
        else if (!strcmp(op, "rmtree")) { rmtree(ARG(1)); i += 1; }
        else if (!strcmp(op, "mv")) { if (rename(ARG(1), ARG(2)) != 0) fail("mv", argv[i + 1]); i += 2; }
        else if (!strcmp(op, "symlink")) { if (symlink(ARG(1), ARG(2)) != 0) fail("symlink", argv[i + 2]); i += 2; }
        else if (!strcmp(op, "try-read")) {
            int fd = open(ARG(1), O_RDONLY);
            if (fd >= 0) { printf("opened %s\n", argv[i + 1]); return 3; }
            printf("refused %s: %s\n", argv[i + 1], strerror(errno)); i += 1;
        }
        else if (!strcmp(op, "try-write")) {
            int fd = open(ARG(1), O_WRONLY | O_CREAT, 0666);
            if (fd >= 0) { printf("created %s\n", argv[i + 1]); return 3; }
            printf("refused %s: %s\n", argv[i + 1], strerror(errno)); i += 1;
        }
        else if (!strcmp(op, "sleep")) { usleep((useconds_t)atoi(ARG(1)) * 1000); i += 1; }
        else if (!strcmp(op, "spin")) { volatile unsigned long n = 0; for (;;) n++; }
        else if (!strcmp(op, "hog")) {
            /* Each block escapes through a volatile pointer: the compiler may
             * not elide the allocation. */
            static char *volatile keep;
            for (;;) { char *p = malloc(1 << 20); if (!p) { fprintf(stderr, "fsops: hog: out of memory\n"); return 4; } memset(p, 1, 1 << 20); keep = p; }
        }
        else if (!strcmp(op, "exit")) { fflush(stdout); return atoi(ARG(1)); }
        else { fprintf(stderr, "fsops: unknown operation %s\n", op); return 2; }
    }
    fflush(stdout);
    return 0;
}
