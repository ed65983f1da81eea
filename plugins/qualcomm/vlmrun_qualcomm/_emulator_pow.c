/* The HTP emulator's hot spot, routed to an exact fast path.
 *
 * onnxruntime-qnn's x86_64 HTP emulator (libQnnHtp.so) spends about half of a graph's run in libm's pow(), called
 * tens of millions of times per run and always as pow(2.0, n) with a whole n. For a normal result that value is a
 * double whose exponent field alone is set; outside that range ldexp(1.0, n) rounds as pow does (below the smallest
 * subnormal both give 0, above the largest double both give inf). `route(name)` rewrites the `pow` slots of the
 * loaded libraries whose path contains `name` (their GOT entries, found through the dynamic section) to `pow_fast`,
 * which takes that path and hands every other call to libm's pow.
 *
 * Linux x86_64 and glibc only (dl_iterate_phdr, R_X86_64 relocations, the dynamic section relocated by ld.so).
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <elf.h>
#include <link.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static double (*libm_pow)(double, double) = pow;

static double pow_fast(double x, double y)
{
    if (x == 2.0 && y >= -1100.0 && y <= 1100.0) {
        int n = (int)y;
        if ((double)n == y) {
            if (n >= -1022 && n <= 1023) {  /* a normal double: 2^n is its exponent field alone */
                union { uint64_t bits; double value; } u = {(uint64_t)(n + 1023) << 52};
                return u.value;
            }
            return ldexp(1.0, n);  /* subnormal, 0 or inf, rounded as pow rounds them */
        }
    }
    return libm_pow(x, y);
}

struct search {
    const char *name;   /* a substring of the library's path */
    int found;          /* libraries matched */
    int routed;         /* slots rewritten (or already routed) */
    int failed;         /* slots that could not be written */
    uintptr_t relro_start, relro_end;  /* the library being visited: its RELRO range (read-only once loaded) */
};

static uintptr_t absolute(uintptr_t value, uintptr_t base)
{
    /* ld.so relocates these entries of a loaded library's dynamic section in place; tolerate one that is not */
    return value < base ? value + base : value;
}

static int write_slot(const struct search *s, void **slot, void *value)
{
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)slot & ~(uintptr_t)(page - 1);
    if (*slot == value) {
        return 0;
    }
    if ((uintptr_t)slot < s->relro_start || (uintptr_t)slot >= s->relro_end) {
        *slot = value;  /* outside RELRO the GOT stays writable (lazy binding writes it) */
        return 0;
    }
    /* RELRO: the GOT of a BIND_NOW library is read-only once loaded; made writable for the write, then restored */
    if (mprotect((void *)start, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
        return -1;
    }
    *slot = value;
    mprotect((void *)start, (size_t)page, PROT_READ);
    return 0;
}

static void route_table(struct search *s, uintptr_t base, const ElfW(Rela) *rela, size_t size,
                        const ElfW(Sym) *symtab, const char *strtab)
{
    size_t count = size / sizeof(ElfW(Rela));
    for (size_t i = 0; i < count; i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) {
            continue;
        }
        const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(rela[i].r_info)];
        if (strcmp(strtab + sym->st_name, "pow") != 0) {
            continue;
        }
        if (write_slot(s, (void **)(base + rela[i].r_offset), (void *)pow_fast) == 0) {
            s->routed++;
        } else {
            s->failed++;
        }
    }
}

static int visit(struct dl_phdr_info *info, size_t size, void *data)
{
    struct search *s = data;
    (void)size;
    if (info->dlpi_name == NULL || strstr(info->dlpi_name, s->name) == NULL) {
        return 0;
    }
    const ElfW(Dyn) *dyn = NULL;
    s->relro_start = s->relro_end = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_DYNAMIC) {
            dyn = (const ElfW(Dyn) *)(info->dlpi_addr + ph->p_vaddr);
        } else if (ph->p_type == PT_GNU_RELRO) {
            s->relro_start = info->dlpi_addr + ph->p_vaddr;
            s->relro_end = s->relro_start + ph->p_memsz;
        }
    }
    if (dyn == NULL) {
        return 0;
    }
    uintptr_t base = info->dlpi_addr;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmprel_size = 0, rela_size = 0;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)absolute(dyn->d_un.d_ptr, base); break;
        case DT_STRTAB: strtab = (const char *)absolute(dyn->d_un.d_ptr, base); break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)absolute(dyn->d_un.d_ptr, base); break;
        case DT_PLTRELSZ: jmprel_size = dyn->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)absolute(dyn->d_un.d_ptr, base); break;
        case DT_RELASZ: rela_size = dyn->d_un.d_val; break;
        default: break;
        }
    }
    if (symtab == NULL || strtab == NULL) {
        return 0;
    }
    s->found++;
    if (jmprel != NULL) {
        route_table(s, base, jmprel, jmprel_size, symtab, strtab);
    }
    if (rela != NULL) {
        route_table(s, base, rela, rela_size, symtab, strtab);
    }
    return 0;
}

static PyObject *route(PyObject *self, PyObject *args)
{
    const char *name;
    (void)self;
    if (!PyArg_ParseTuple(args, "s", &name)) {
        return NULL;
    }
    struct search s = {name, 0, 0, 0, 0, 0};
    dl_iterate_phdr(visit, &s);
    return Py_BuildValue("(iii)", s.found, s.routed, s.failed);
}

static PyObject *value(PyObject *self, PyObject *args)
{
    double x, y;
    (void)self;
    if (!PyArg_ParseTuple(args, "dd", &x, &y)) {
        return NULL;
    }
    return PyFloat_FromDouble(pow_fast(x, y));
}

static PyMethodDef methods[] = {
    {"route", route, METH_VARARGS,
     "route(name) -> (libraries found, pow slots routed, slots that could not be written): the loaded libraries "
     "whose path contains name call pow_fast instead of libm's pow."},
    {"value", value, METH_VARARGS, "value(x, y) -> pow_fast(x, y) (for tests: libm's pow(x, y) bit for bit)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_emulator_pow", NULL, -1, methods};

PyMODINIT_FUNC PyInit__emulator_pow(void)
{
    return PyModule_Create(&module);
}
